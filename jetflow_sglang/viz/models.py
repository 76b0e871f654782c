"""The model side of the explorer: one target, the drafters built on it, and the checks on what the page sends."""
from __future__ import annotations

import threading
import traceback
from pathlib import Path

import gradio as gr

from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.head import load_head
from jetflow_sglang.draft.registry import REGISTRY
from jetflow_sglang.engine.stack import load_stack, pick_head

LOOKUP = "+lookup"  # a head drafter with prompt-lookup tries merged into its trees (drafters.WithLookup)
LABELS = {"jetflow": "JetFlow", "jetflow-branch": "JetFlow branch-conditioned", "ddtree": "DDTree",
          "dflash": "DFlash chain", "ngram": "n-gram (prompt lookup)", "ar": "autoregressive"}
# (label, value) for the page, from the registry: every drafter, and the CLI's default (jetflow + lookup) second
DRAFTERS = [(LABELS.get(n, n), n) for n in REGISTRY]
DRAFTERS.insert(1, ("JetFlow + lookup (jetflow generate's default)", "jetflow" + LOOKUP))
HEAD_DRAFTERS = {v for _, v in DRAFTERS if REGISTRY[v.removesuffix(LOOKUP)].head}
MAX_BUDGET, MAX_TOKENS, MAX_TEMPERATURE = 256, 1024, 2.0
WIDTH, SEED = 8, 0


class InputError(ValueError):
    """Bad input from the page: shown as a message, never as a traceback."""


class Models:
    """The target, the heads and drafters, shared by all tabs. Target owns a batch-1 KV cache, so only one
    generation runs at a time: events share one concurrency slot and this lock guards the model."""

    def __init__(self, target_dir: str, head_dir: str | None, dtype: str = "auto"):
        self.target_dir, self.head_dir, self.dtype = str(target_dir), head_dir, dtype
        self.head_error, self.unavailable = "", {}
        self._drafters: dict[str, object] = {}
        self._heads: dict[str, object] = {}
        self.target = None
        if head_dir is None:
            self.head_error = "no head given"
        else:
            try:
                self.target, self._drafters["jetflow"] = load_stack(target_dir, head_dir, dtype=dtype,
                                                                    drafter="jetflow", width=WIDTH, lookup=False)
            except Exception as e:  # missing, corrupt or mismatched: keep running without the head drafters
                self.head_error = f"{type(e).__name__}: {e}"
        if self.target is None:
            self.target, self._drafters["ngram"] = load_stack(target_dir, None, dtype=dtype, drafter="ngram",
                                                              width=WIDTH)
        for name in HEAD_DRAFTERS:
            reason = self._head_problem(name)
            if reason:
                self.unavailable[name] = reason
        self.lock = threading.Lock()
        self.eos_ids = sorted(self.target.eos_ids())

    def _head_dir_for(self, name: str) -> Path:
        return Path(pick_head(self.head_dir, name.removesuffix(LOOKUP), self.target.config)[0])

    def _head_problem(self, name: str) -> str:
        if self.head_error:
            return self.head_error
        try:
            self._head_dir_for(name)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return ""

    @property
    def has_head(self) -> bool:
        return not self.head_error

    def available(self) -> list[str]:
        return [v for _, v in DRAFTERS if v not in self.unavailable]

    def drafter(self, name: str):
        if name in self.unavailable:
            raise ValueError(f"the {name} drafter is not available ({self.unavailable[name]})")
        if name not in self._drafters:
            head = None
            if name in HEAD_DRAFTERS:
                d = self._head_dir_for(name)
                if str(d) not in self._heads:
                    self._heads[str(d)] = load_head(d, self.target)
                head = self._heads[str(d)]
            base = name.removesuffix(LOOKUP)
            causal = REGISTRY[base].head == "causal"
            self._drafters[name] = make_drafter(base, head if causal else None, None if causal else head, width=WIDTH,
                                                lookup=name.endswith(LOOKUP))
        return self._drafters[name]

    def decode(self, ids) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_one(self, tok: int) -> str:
        return self.target.tokenizer.decode([tok])

    def banner(self) -> str:
        lines = [f"**target** `{self.target_dir}` ({self.target.config.num_hidden_layers} layers, {self.target.dtype})"]
        if self.has_head:
            lines.append(f"**head** `{self.head_dir}`")
            if self.unavailable:
                lines.append("not available: " + "; ".join(f"{k} ({v})" for k, v in sorted(self.unavailable.items())))
        else:
            lines.append(f"⚠️ **draft head missing**: {self.head_error}. Only the n-gram and autoregressive drafters "
                         "are available until a head is trained (see the README).")
        return "  \n".join(lines)

    def meta(self) -> dict:
        return dict(target=self.target_dir, head=self.head_dir, dtype=self.dtype)


def _number(value, name: str, kind):
    try:
        v = kind(float(value)) if kind is int else float(value)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{name} must be a number; got {value!r}.") from None
    if kind is int and float(value) != v:
        raise InputError(f"{name} must be a whole number; got {value}.")
    return v


def check_inputs(models: Models, prompt, drafter, budget, temperature, max_tokens) -> tuple[str, int, float, int]:
    """Reject, before touching the model, anything the engine would reject. Never clamps: out of range is a message."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("The prompt is empty: type one or pick an example.")
    if drafter not in dict((v, k) for k, v in DRAFTERS):
        raise InputError(f"Unknown drafter {drafter!r}.")
    if drafter not in models.available():
        raise InputError(f"The {drafter} drafter is not available ({models.unavailable.get(drafter, '')}).")
    budget = _number(budget, "Budget", int)
    temperature = _number(temperature, "Temperature", float)
    max_tokens = _number(max_tokens, "Max tokens", int)
    if not 1 <= budget <= MAX_BUDGET:
        raise InputError(f"Budget must be between 1 and {MAX_BUDGET} nodes; got {budget}. Nothing was run.")
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InputError(f"Temperature must be between 0 and {MAX_TEMPERATURE:g}; got {temperature:g}. Nothing was run.")
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise InputError(f"Max tokens must be between 1 and {MAX_TOKENS}; got {max_tokens}. Nothing was run.")
    return drafter, budget, temperature, max_tokens


def notice(e: Exception) -> str:
    """Turn an exception into a message for the page (a toast plus the returned markdown); any traceback goes
    to the server log only. Raising gr.Error instead would also paint an error badge over every output."""
    if isinstance(e, InputError):
        msg = str(e)
    elif isinstance(e, ValueError):  # the engine's own checks: budgets, prompts too long for the context, ...
        msg = f"Rejected: {e}"
    else:
        traceback.print_exc()
        msg = f"Generation failed ({type(e).__name__}: {e}); details are in the server log."
    gr.Warning(msg)
    return f"⚠️ {msg}"
