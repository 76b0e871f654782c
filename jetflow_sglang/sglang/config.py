"""The JETFLOW server configuration: one typed object, resolved once from SGLang's own flags plus the variables below.

SGLang flags (preferred; they exist for every speculative algorithm):
    --speculative-num-draft-tokens N   budget: draft-tree nodes per request and round, root included. Given alone
                                       it FIXES the budget at N; without it the budget is adaptive (`auto`, up to
                                       32 on a CPU, 64 on a GPU: DEFAULT_BUDGET). It is also the number of KV slots SGLang reserves per request and step.
    --speculative-eagle-topk K         width: children considered per tree node (default 8)
    --speculative-num-steps D          depth: maximum tree depth (default: the head's block size - 1)
    --speculative-draft-model-path P   the draft head folder (a head drafter is used when it is given)

Environment (only what SGLang has no flag for; read once, never written):
    JETFLOW_DRAFTER   jetflow | ddtree | dflash | ngram | ar  (jetflow-branch: CLI only)
                      (default: the head's own kind - jetflow for a causal head, ddtree for a bidirectional
                      one such as a DFlash release - and ngram without a head; a drafter that does not fit
                      the head is an error)
    JETFLOW_BUDGET    auto | N     auto (the default when --speculative-num-draft-tokens is not given, as in
                                   `jetflow generate`): each round's tree size adapts, up to the budget above
                                   (0 or 1 nodes = plain decoding when trees do not pay);
                                   N: a fixed budget, the same as --speculative-num-draft-tokens N
                                   (giving both with different values is an error)
    JETFLOW_TREE      exact           how the tree is built from the head's per-depth top-k (paper: CLI only)
    JETFLOW_LOOKUP    auto | on | off   merge prompt-lookup continuations (repeats of the request's own context) into
                      each head tree, competing for the same budget (drafters.WithLookup). The n-gram match and the
                      merge run on the device for the whole batch (lookup_batch), about 1-2 ms per step on a 2-core
                      CPU: auto (default) turns it on where the server runs on the CPU and off on a GPU, where it is
                      not yet measured
    JETFLOW_OVERLAP   auto | on | off   SGLang's overlap scheduler (the host prepares round k+1 while the device runs
                      round k). auto (default): on, except on a CPU, where SGLang keeps its own speculative
                      algorithms synchronous; on: overlap on a CPU server too; off: synchronous everywhere (as
                      --disable-overlap-schedule, which always wins)
    JETFLOW_COUNT_SYNCS  0 | 1     count, per decode round, the calls that could make the host wait for the device
                      (host_syncs.py), reported in /server_info; for tests and benchmarks (default 0)
    JETFLOW_GRAPHS    off | on | check   replay the round's head forward (over a paged context), tree build and
                      acceptance from captures, one per (batch bucket, budget) (core/graphs.py): CUDA graphs on a
                      GPU (not yet run on one), a replayed ATen trace on a CPU (the same kernels: a proof of the
                      capture, not a speed-up); check: also run each piece eagerly and fail on any difference
                      (tests). Default off
    JETFLOW_COST_PRIOR  JSON {verified tokens: seconds}, e.g. '{"1": 0.01, "8": 0.02}': the verify-cost prior of
                      JETFLOW_BUDGET=auto (only valid with it; default: the adaptive budget's own prior)

SGLang keeps the raw flag values on its ServerArgs record (its resolution only adds declarations), so the launcher
(the plugin's argument hook) and every scheduler process (the worker) compute the same config from the same record
and the inherited environment; nothing is passed through os.environ writes.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Mapping

from jetflow_sglang.draft.registry import CLI_ONLY_DRAFTERS, DEFAULT_WIDTH, DRAFTERS, HEAD_DRAFTERS, SERVER_DRAFTERS, TREES
from jetflow_sglang.core.tree import MAX_BUDGET  # the one budget maximum (the tree builders', the CLI's and the server's)

ALGORITHM = "JETFLOW"  # --speculative-algorithm JETFLOW (any case)


def is_jetflow(name) -> bool:
    return isinstance(name, str) and name.upper() == ALGORITHM

# auto's maximum without --speculative-num-draft-tokens, by device. A CPU's verify cost grows with the tree: 16-32
# nodes pay at batch 1 and auto steps down under load (bench/results/sglang_budget*). A GPU verifies 256 nodes for
# about the cost of one (bench/results/h200), but SGLang reserves 2 x budget KV slots per running request each step:
# 64 (the paper's smallest budget) keeps that reservation at 128 slots per request.
DEFAULT_BUDGET = {"cpu": 32, "accelerator": 64}


def default_budget(device) -> int:
    """auto's maximum on `device` (SGLang's --device; None: SGLang picks an accelerator)."""
    return DEFAULT_BUDGET["cpu" if str(device or "").strip().lower() == "cpu" else "accelerator"]

ENV_VARS = ("JETFLOW_DRAFTER", "JETFLOW_BUDGET", "JETFLOW_TREE", "JETFLOW_COST_PRIOR", "JETFLOW_LOOKUP", "JETFLOW_OVERLAP",
            "JETFLOW_COUNT_SYNCS", "JETFLOW_GRAPHS")
GRAPHS = ("off", "on", "check")
SWITCH_VALUES = {"auto": None, "on": True, "1": True, "true": True, "off": False, "0": False, "false": False}
RETIRED_ENV = {  # read by earlier versions; failing beats silently ignoring them
    "JETFLOW_WIDTH": "--speculative-eagle-topk",
    "JETFLOW_DEPTH": "--speculative-num-steps",
}
FLAGS = {"budget": "--speculative-num-draft-tokens", "width": "--speculative-eagle-topk",
         "depth": "--speculative-num-steps"}


class JetFlowConfigError(ValueError):
    """A bad JETFLOW setting; the message is one line that names the flag or variable."""


@dataclass(frozen=True)
class JetFlowServerConfig:
    drafter: str
    budget: int  # max tree nodes incl. root = KV slots reserved per request per step
    adaptive: bool  # JETFLOW_BUDGET=auto: each round picks <= budget nodes
    width: int
    depth: int | None  # None: the head's block size - 1
    tree: str  # "exact" | "paper"
    head_dir: str | None = None
    cost_prior: dict | None = None  # {verified tokens: seconds} for AdaptiveBudget(cost_prior=...)
    lookup: bool = False  # JETFLOW_LOOKUP: prompt-lookup tries merged into the head's trees (lookup_batch)
    overlap: bool = False  # JETFLOW_OVERLAP: run on SGLang's overlap scheduler (unless --disable-overlap-schedule)
    count_syncs: bool = False  # JETFLOW_COUNT_SYNCS: count each decode round's host synchronisations (host_syncs.py)
    graphs: str = "off"  # JETFLOW_GRAPHS: off | on | check (core/graphs.py)

    @property
    def needs_head(self) -> bool:
        return self.drafter in HEAD_DRAFTERS

    @classmethod
    def from_server_args(cls, server_args, env: Mapping[str, str] | None = None) -> "JetFlowServerConfig":
        """Resolve from an SGLang ServerArgs record (or any object with its field names) and the environment
        (`env`, default os.environ). Raises JetFlowConfigError with a one-line message on any bad value."""
        env = os.environ if env is None else env
        raw = _raw_fields(server_args)
        for name, flag in RETIRED_ENV.items():
            if env.get(name, "") != "":
                raise JetFlowConfigError(f"{name} is no longer read; use {flag} instead")
        head_dir = raw.get("speculative_draft_model_path") or None
        head_dir = str(head_dir) if head_dir is not None else None

        requested = (env.get("JETFLOW_DRAFTER") or "").strip().lower() or None
        if requested is not None and requested not in DRAFTERS:
            raise JetFlowConfigError(f"JETFLOW_DRAFTER={requested!r} is not a drafter; "
                                     f"choose one of {', '.join(DRAFTERS)}")
        drafter = _drafter(requested, head_dir)
        if drafter in CLI_ONLY_DRAFTERS:
            raise JetFlowConfigError(f"JETFLOW_DRAFTER={drafter} is not available in the batched server (CLI-only: "
                                     f"jetflow generate --drafter {drafter}); use one of {', '.join(SERVER_DRAFTERS)}")

        tree = (env.get("JETFLOW_TREE") or "exact").strip().lower()
        if tree not in TREES:
            raise JetFlowConfigError(f"JETFLOW_TREE={tree!r} is not a tree builder; choose one of {', '.join(TREES)}")
        if tree != "exact":
            raise JetFlowConfigError(f"JETFLOW_TREE={tree} is not available in the server, which builds exact top-B "
                                     "trees for the whole batch on the device; the paper's eager builder is "
                                     "CLI-only (jetflow generate --tree paper)")

        budget, adaptive = _budget(raw.get("speculative_num_draft_tokens"), env.get("JETFLOW_BUDGET"),
                                   default_budget(raw.get("device")))
        width = _flag_int("width", raw.get("speculative_eagle_topk"), DEFAULT_WIDTH)
        depth = _flag_int("depth", raw.get("speculative_num_steps"), None)
        cost_prior = _cost_prior(env.get("JETFLOW_COST_PRIOR"), adaptive)
        lookup = _lookup(env.get("JETFLOW_LOOKUP"), drafter, raw.get("device"))
        overlap = _switch("JETFLOW_OVERLAP", env.get("JETFLOW_OVERLAP"))
        if overlap is None:
            overlap = str(raw.get("device") or "").strip().lower() != "cpu"
        count_syncs = bool(_switch("JETFLOW_COUNT_SYNCS", env.get("JETFLOW_COUNT_SYNCS") or "off"))
        graphs = (env.get("JETFLOW_GRAPHS") or "off").strip().lower()
        if graphs not in GRAPHS:
            raise JetFlowConfigError(f"JETFLOW_GRAPHS must be {', '.join(GRAPHS)}; got {env.get('JETFLOW_GRAPHS')!r}")
        return cls(drafter=drafter, budget=budget, adaptive=adaptive, width=width, depth=depth, tree=tree,
                   head_dir=head_dir, cost_prior=cost_prior, lookup=lookup, overlap=overlap, count_syncs=count_syncs,
                   graphs=graphs)

    def describe(self) -> str:
        mode = "auto, up to" if self.adaptive else "fixed"
        return (f"drafter={self.drafter} budget={mode} {self.budget} width={self.width} "
                f"depth={self.depth if self.depth is not None else 'head'} tree={self.tree} "
                f"lookup={'on' if self.lookup else 'off'} overlap={'on' if self.overlap else 'off'} graphs={self.graphs}")


def _raw_fields(server_args) -> dict:
    """The values the operator gave. On a resolved SGLang record the fields themselves still hold the raw input
    (`_raw_input` is the snapshot taken when resolution starts); on a resolving view or a plain namespace they are
    read as attributes."""
    names = ("speculative_num_draft_tokens", "speculative_eagle_topk", "speculative_num_steps",
             "speculative_draft_model_path", "device")
    snap = getattr(server_args, "_raw_input", None)
    if isinstance(snap, dict):
        return {n: snap.get(n) for n in names}
    return {n: getattr(server_args, n, None) for n in names}


def _head_is_causal(head_dir: str) -> bool:
    """Read the head's config.json (either format; no weights) and say whether it is causal."""
    from jetflow_sglang.head import CheckpointError, HeadMismatchError, read_head_config

    try:
        head_cfg, _fmt = read_head_config(head_dir)
    except (CheckpointError, HeadMismatchError, ValueError, OSError) as e:
        raise JetFlowConfigError(f"--speculative-draft-model-path {head_dir}: {e}") from None
    return bool(head_cfg.causal)


def _drafter(requested: str | None, head_dir: str | None) -> str:
    from jetflow_sglang.draft.registry import BIDIRECTIONAL_DRAFTERS, CAUSAL_DRAFTERS

    if head_dir is None:
        if requested in HEAD_DRAFTERS:
            raise JetFlowConfigError(f"JETFLOW_DRAFTER={requested} needs a draft head: pass "
                                     "--speculative-draft-model-path HEAD_DIR (or use JETFLOW_DRAFTER=ngram)")
        return requested or "ngram"
    if requested is not None and requested not in HEAD_DRAFTERS:
        return requested  # ngram / ar ignore the head
    causal = _head_is_causal(head_dir)
    fits = CAUSAL_DRAFTERS if causal else BIDIRECTIONAL_DRAFTERS
    if requested is None:
        return fits[0]
    if requested not in fits:
        kind = "causal" if causal else "bidirectional"
        raise JetFlowConfigError(f"JETFLOW_DRAFTER={requested} does not fit the {kind} head at {head_dir}; "
                                 f"use JETFLOW_DRAFTER={' or '.join(fits)}")
    return requested


def _switch(name: str, value) -> bool | None:
    """auto | on | off (also 1/0, true/false) -> None | True | False."""
    mode = (value or "auto").strip().lower()
    if mode not in SWITCH_VALUES:
        raise JetFlowConfigError(f"{name} must be auto, on or off; got {value!r}")
    return SWITCH_VALUES[mode]


def _lookup(value, drafter: str, device) -> bool:
    wanted = _switch("JETFLOW_LOOKUP", value)
    if drafter not in HEAD_DRAFTERS:
        if wanted:
            raise JetFlowConfigError(f"JETFLOW_LOOKUP=on merges prompt lookup into a head's trees, but the drafter is "
                                     f"{drafter} (no head; JETFLOW_DRAFTER=ngram is prompt lookup alone)")
        return False
    return (str(device or "").strip().lower() == "cpu") if wanted is None else wanted


def _cost_prior(value, adaptive: bool) -> dict | None:
    if value is None or not str(value).strip():
        return None
    if not adaptive:
        raise JetFlowConfigError("JETFLOW_COST_PRIOR only applies to an adaptive budget (JETFLOW_BUDGET=auto, the "
                                 "default without --speculative-num-draft-tokens)")
    bad = JetFlowConfigError(f"JETFLOW_COST_PRIOR must be a JSON object of verified tokens (>= 1) to seconds (> 0), "
                             f"e.g. '{{\"1\": 0.01, \"8\": 0.02}}'; got {value!r}")
    try:
        raw = json.loads(value)
    except ValueError:
        raise bad from None
    if not isinstance(raw, dict) or not raw:
        raise bad
    prior = {}
    for k, v in raw.items():
        try:
            tokens, seconds = int(k), float(v)
        except (TypeError, ValueError):
            raise bad from None
        if str(tokens) != str(k).strip() or tokens < 1 or isinstance(v, bool) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise bad
        prior[tokens] = seconds
    return prior


def _as_int(what: str, value) -> int:
    if isinstance(value, bool):
        raise JetFlowConfigError(f"{what} must be a positive integer; got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise JetFlowConfigError(f"{what} must be a positive integer; got {value!r}") from None


def _flag_int(key: str, value, default):
    if value is None:
        return default
    v = _as_int(FLAGS[key], value)
    if v < 1:
        raise JetFlowConfigError(f"{FLAGS[key]} must be at least 1 for JETFLOW; got {v}")
    if v > MAX_BUDGET:
        raise JetFlowConfigError(f"{FLAGS[key]} must be at most {MAX_BUDGET}; got {v}")
    return v


def _budget(flag, env_value, default: int) -> tuple[int, bool]:
    """(budget, adaptive) from --speculative-num-draft-tokens and JETFLOW_BUDGET (see the module docstring); default:
    auto's maximum when the flag is not given."""
    from_flag = _flag_int("budget", flag, None)
    mode = (env_value or "").strip().lower()
    if mode == "":  # no JETFLOW_BUDGET: the flag fixes the budget; without the flag it is auto (the CLI's default)
        return (from_flag, False) if from_flag is not None else (default, True)
    if mode == "auto":
        return (from_flag or default), True
    try:
        n = int(mode)
    except ValueError:
        raise JetFlowConfigError(f"JETFLOW_BUDGET must be auto or a positive integer; got {env_value!r}") from None
    if not 1 <= n <= MAX_BUDGET:
        raise JetFlowConfigError(f"JETFLOW_BUDGET must be auto or an integer in 1..{MAX_BUDGET}; got {n}")
    if from_flag is not None and from_flag != n:
        raise JetFlowConfigError(f"JETFLOW_BUDGET={n} conflicts with --speculative-num-draft-tokens {from_flag}; "
                                 "set only one")
    return n, False
