"""The target's view of a verified tree: its probability of every drafted token and its top-k at every node.

The verify forward already computes the target's logits at every node. `RecordingTarget` wraps a Target and keeps
a reference to the last verify's logits (no copy, no compute inside the engine's timed region); `round_view` turns
them into plain lists after the round has been yielded. When the engine itself fills `Round.target_top`
(generate(..., target_topk=k)), that top-k is used and the logits only supply each node's own probability.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.core.verify import process_logits

TOPK = 5


@dataclass
class TargetView:
    top_ids: list[list[int]]     # [n][k]: the target's top-k next tokens after node i (row i predicts i's children)
    top_probs: list[list[float]]
    node_p: list[float | None]   # target probability of node i's token at its parent (root: None)


class RecordingTarget:
    """A Target that remembers the logits of its last `verify`. Everything else goes straight to the target."""

    def __init__(self, target):
        self._target = target
        self.last_logits: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def verify(self, *args, **kw):
        out = self._target.verify(*args, **kw)
        self.last_logits = out[0] if isinstance(out, tuple) else out
        return out


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution acceptance uses: plain softmax for greedy runs, the processed one when sampling."""
    if temperature == 0:
        return logits.float().softmax(-1)
    return process_logits(logits, temperature, top_k, top_p)


def round_view(tree: DraftTree, logits: torch.Tensor | None, temperature: float, top_k: int = 0,
               top_p: float = 1.0, engine_top=None, k: int = TOPK) -> TargetView | None:
    """The target's view of one round; None when neither the logits nor the engine's top-k are there."""
    if logits is None and engine_top is None:
        return None
    n = len(tree)
    node_p: list[float | None] = [None] * n
    if logits is not None and logits.shape[0] >= n:
        probs = target_probs(logits[:n].detach().cpu(), temperature, top_k, top_p)
        if n > 1:
            parents = torch.tensor(tree.parents[1:])
            toks = torch.tensor(tree.tokens[1:])
            node_p[1:] = probs[parents, toks].tolist()
        if engine_top is None:
            vals, ids = probs.topk(min(k, probs.shape[-1]), -1)
            return TargetView(ids.tolist(), [[round(v, 6) for v in row] for row in vals.tolist()], node_p)
    ids, vals = engine_top
    ids, vals = ids[:n, :k].tolist(), vals[:n, :k].float().tolist()
    if logits is None:  # only the top-k: a node's probability is known when its token is in its parent's top-k
        for i in range(1, n):
            row = ids[tree.parents[i]]
            if tree.tokens[i] in row:
                node_p[i] = vals[tree.parents[i]][row.index(tree.tokens[i])]
    return TargetView(ids, [[round(v, 6) for v in row] for row in vals], node_p)
