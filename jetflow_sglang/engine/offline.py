"""Exact greedy acceptance without running the verify forward.

For greedy decoding the accepted path is fully determined by the target's own greedy continuation: a round accepts
the longest tree path that spells the next reference tokens. So given the reference and the target's taps along it
(one teacher-forced forward), a drafter can be walked through the same rounds the engine would run, at a fraction
of the cost. `tests/test_offline.py` checks the walk against the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from jetflow_sglang.draft.drafters import ARDrafter
from jetflow_sglang.core.tree import DraftTree, best_first, check_budget, per_depth
from jetflow_sglang.core.tree_batch import build_topb


def accepted_length(tree: DraftTree, upcoming) -> int:
    """Number of draft nodes accepted when the target's next tokens are `upcoming`."""
    node, n = 0, 0
    for tok in upcoming:
        node = next((c for c in tree.children(node) if tree.tokens[c] == tok), None)
        if node is None:
            break
        n += 1
    return n


@dataclass
class Walk:
    steps: int
    tokens: int  # tokens produced by verify steps (the prefill token excluded)
    draft_s: float  # draft + head advance, summed over steps
    nodes: int  # tree nodes verified, summed over steps

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.steps)


def walk(drafter, prompt_ids, continuation, taps: torch.Tensor, budget: int) -> Walk:
    """Rounds the engine would run to emit `continuation` (its [0] comes from prefill). taps: [P + len(cont), ...]."""
    check_budget(budget)
    p, cont = len(prompt_ids), list(continuation)
    state = drafter.new_state(list(prompt_ids), taps[:p])
    i, steps, draft_s, nodes = 0, 0, 0.0, 0
    while i < len(cont) - 1:
        t0 = time.perf_counter()
        tree = drafter.draft(state, cont[i], budget)
        draft_s += time.perf_counter() - t0
        acc = accepted_length(tree, cont[i + 1:])
        steps, nodes = steps + 1, nodes + len(tree)
        t0 = time.perf_counter()
        drafter.advance(state, cont[i:i + acc + 1], taps[p + i:p + i + acc + 1])
        draft_s += time.perf_counter() - t0  # advancing the head is drafting cost too
        i += acc + 1
    return Walk(steps, len(cont) - 1, draft_s, nodes)


class OracleDrafter(ARDrafter):
    """The target's own per-depth top-k along its greedy path, fed to the exact top-B builder: a ceiling for drafters.

    eager=True builds the paper's eager form instead (only to compare builders; the ceiling is the exact tree)."""
    name = "oracle"

    def __init__(self, target_logits: torch.Tensor, width: int = 8, depth: int = 15, eager: bool = False):
        self.logp = target_logits.float().log_softmax(-1)
        self.width, self.depth, self.eager = min(width, self.logp.shape[-1]), depth, eager

    def draft(self, state, anchor, budget, temperature=0.0, generator=None) -> DraftTree:
        check_budget(budget)
        at = len(state.tokens)  # the anchor's row; its logits predict depth 1
        lp = self.logp[at:at + self.depth]
        if budget == 1 or len(lp) == 0:
            return DraftTree.root(anchor)
        vals, idx = lp.topk(self.width, -1)
        if self.eager:
            return best_first(anchor, per_depth(idx.tolist(), vals.tolist()), budget, self.width, len(lp), True)
        return build_topb(torch.tensor([int(anchor)]), idx[None], vals[None], budget).tree(0)
