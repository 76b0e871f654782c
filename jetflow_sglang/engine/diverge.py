"""Where two greedy continuations part, and whether the target was at a near-tie there.

In bfloat16 a multi-token forward (a verify step) and a one-token decode step round differently, so at a near-tie
the two can pick different argmax tokens; after that the texts differ. `first_divergence` finds the first differing
position and recomputes the target's top-2 logits there both ways, so `jetflow generate --compare-ar` can show
"near-tie (margin 0.03)" instead of leaving the user to suspect a bug.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

NEAR_TIE = 0.25  # a top-2 logit gap below this is within bf16 rounding of a 30-layer model's logits


def _top2(logits: torch.Tensor) -> list[tuple[int, float]]:
    vals, idx = logits.float().topk(2)
    return [(int(i), float(v)) for i, v in zip(idx, vals)]


@torch.no_grad()
def _ar_logits(model, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """Logits after prompt + prefix as plain decoding computes them: prefill, then one token per forward."""
    cache = DynamicCache(config=model.config)
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True)
    for tok in prefix:
        out = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


@torch.no_grad()
def _batched_logits(model, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """Logits after prompt + prefix as a verify step computes them: the generated prefix in one multi-token forward."""
    cache = DynamicCache(config=model.config)
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True)
    if prefix:
        out = model(input_ids=torch.tensor([prefix], device=dev), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float()


def _side(logits: torch.Tensor, a_tok: int | None, b_tok: int | None) -> dict:
    top = _top2(logits)
    gap = None
    if a_tok is not None and b_tok is not None:
        gap = float(logits[a_tok] - logits[b_tok])
    return {"top2": top, "margin": top[0][1] - top[1][1], "a_minus_b": gap}


def first_divergence(target, prompt_ids: Sequence[int], a_tokens: Sequence[int], b_tokens: Sequence[int]) -> dict | None:
    """First position where a_tokens (speculative) and b_tokens (autoregressive) differ, or None if identical.

    Returns {"position", "a_token", "b_token" (None past the end of a shorter list), "margin_a", "margin_ar",
    "gap_a", "gap_ar", "top2_a", "top2_ar", "near_tie"}:
    margin_*: the target's top-1 minus top-2 logit at that position, computed as a batched multi-token forward of
    the shared prefix (margin_a, what a verify step sees) and as one-token decode steps (margin_ar);
    gap_*: logit(a_token) - logit(b_token) in each computation (positive: that computation prefers a_token);
    near_tie: both margins are below NEAR_TIE, so the difference is rounding, not a bug;
    explained: the batched forward prefers a_token and the one-token steps prefer b_token.
    """
    prompt, a, b = [int(t) for t in prompt_ids], [int(t) for t in a_tokens], [int(t) for t in b_tokens]
    if not prompt:
        raise ValueError("first_divergence needs the prompt's token ids; got an empty prompt")
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None:
        if len(a) == len(b):
            return None
        pos = min(len(a), len(b))  # one stopped earlier (EOS or the limit)
    a_tok = a[pos] if pos < len(a) else None
    b_tok = b[pos] if pos < len(b) else None
    model = target.model if hasattr(target, "model") else target
    spec = _side(_batched_logits(model, prompt, a[:pos]), a_tok, b_tok)
    ar = _side(_ar_logits(model, prompt, a[:pos]), a_tok, b_tok)
    return {"position": pos, "a_token": a_tok, "b_token": b_tok,
            "margin_a": spec["margin"], "margin_ar": ar["margin"], "gap_a": spec["a_minus_b"], "gap_ar": ar["a_minus_b"],
            "top2_a": spec["top2"], "top2_ar": ar["top2"],
            "near_tie": max(spec["margin"], ar["margin"]) < NEAR_TIE,
            "explained": spec["a_minus_b"] is not None and spec["a_minus_b"] >= 0 >= ar["a_minus_b"]}


def format_divergence(d: dict | None, tokenizer=None) -> str:
    """One or two lines for `jetflow generate --compare-ar`."""
    if d is None:
        return "identical to AR: True"
    show = (lambda t: "<end>" if t is None else f"{t} {tokenizer.decode([t])!r}") if tokenizer else \
        (lambda t: "<end>" if t is None else str(t))
    line = (f"identical to AR: False - first difference at new token {d['position']}: "
            f"speculative {show(d['a_token'])} vs AR {show(d['b_token'])}")
    if d["a_token"] is None or d["b_token"] is None:
        return line + " (one run stopped earlier)"
    verdict = ("a near-tie: the two computations round it differently (expected in bfloat16; --exact on makes "
               "them agree)"
               if d["near_tie"] else "NOT a near-tie: please report this as a bug")
    return (line + f"\n  target top-2 logit margin there: {d['margin_a']:.3f} in a batched forward, "
            f"{d['margin_ar']:.3f} in one-token steps; {verdict}")


__all__ = ["NEAR_TIE", "first_divergence", "format_divergence"]
