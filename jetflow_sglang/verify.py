"""Acceptance rules: which root-to-node path of a verified tree the target keeps, plus its bonus token.

Greedy keeps the deepest path whose every token is the target's argmax at its parent. Sampling walks the tree with
recursive rejection sampling over each node's children, so the output follows the target's (processed) distribution
exactly whatever the draft proposed.
"""
from __future__ import annotations

import torch

from .tree import DraftTree


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off); got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Target probabilities after temperature, top-k and top-p: the distribution sampling must reproduce."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_accept(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    node, path = 0, [0]
    while True:
        want = argmax[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _normalise(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    s = p.sum()
    return p / s if s > 0 else fallback


def sample_accept(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree.

    At a node with target distribution p, children x_1..x_m are tested in order. If the tree carries the draft
    distribution q the children were drawn from without replacement, x_j is accepted with min(1, p(x_j)/q(x_j)); on
    rejection p <- norm(max(p - q, 0)) and x_j is removed from q. Without q (deterministic candidates) the proposal is a
    point mass: accept with p(x_j), else zero it in p. If every child is rejected the bonus token is drawn from the
    residual. Either way the emitted token is distributed exactly as the target's p.
    """
    node, path = 0, [0]
    while True:
        p = probs[node].double().cpu()  # draws use a CPU generator whatever the device: same seed, same tokens
        q = tree.child_probs[node] if tree.child_probs is not None else None
        q = q.double().clone() if q is not None else None
        chosen = None
        for child in tree.children(node):
            x = tree.tokens[child]
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if q is None:
                if u < p[x]:
                    chosen = child
                    break
                p = p.clone()
                p[x] = 0.0
                p = _normalise(p, probs[node].double().cpu())
            else:
                if q[x] > 0 and u < torch.clamp(p[x] / q[x], max=1.0):
                    chosen = child
                    break
                p = _normalise(torch.clamp(p - q, min=0.0), p)
                q[x] = 0.0
                q = _normalise(q, q)
        if chosen is None:
            bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            return path, bonus
        path.append(chosen)
        node = chosen
