"""Acceptance diagnostics of a run, from each round's draft tree and accepted path. Pure maths, no plotting.

A node is *tried* when its parent was accepted (the target looked at that slot), and *accepted* when it lies on the
accepted path. Everything below counts tried nodes only: a node under a rejected parent says nothing about the draft.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from jetflow_sglang.core.tree import DraftTree

RANK_GROUPS = ((1, 1), (2, 8), (9, None))  # sibling rank 1 vs 2-8 (vs 9+, only shown when a tree is that wide)


@dataclass(frozen=True)
class Rate:
    label: str
    accepted: int
    tried: int

    @property
    def rate(self) -> float | None:
        return self.accepted / self.tried if self.tried else None


@dataclass(frozen=True)
class Bin:
    lo: float
    hi: float
    count: int          # tried nodes whose draft per-step probability falls in [lo, hi) (the last bin includes 1.0)
    mean_p: float       # their mean draft per-step probability (what the draft predicted)
    accepted: int       # how many of them the target accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.count


def step_probs(tree: DraftTree) -> list[float]:
    """Per-step draft probability of each node given its parent: exp(logp[i] - logp[parent]); the root is 1."""
    out = [1.0]
    for i in range(1, len(tree)):
        p = tree.parents[i]
        out.append(min(1.0, math.exp(tree.logps[i] - tree.logps[p])))
    return out


def sibling_ranks(tree: DraftTree) -> list[int]:
    """1-based rank of each node among its siblings by per-step draft log-prob (ties: earlier node first); root 0."""
    ranks = [0] * len(tree)
    for parent in range(len(tree)):
        kids = sorted(tree.children(parent), key=lambda k: (-(tree.logps[k] - tree.logps[parent]), k))
        for r, k in enumerate(kids, 1):
            ranks[k] = r
    return ranks


def tried_nodes(tree: DraftTree, path: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, accepted) for every node whose parent is on the accepted path."""
    on_path = set(path)
    return [(k, k in on_path) for p in path for k in tree.children(p)]


def by_depth(rounds: Iterable[tuple[DraftTree, Sequence[int]]]) -> list[Rate]:
    """Acceptance rate at each depth d >= 1: of the rounds whose accepted path reached depth d-1 with the tree
    offering at least one child there, the fraction that accepted a node at depth d."""
    tried: dict[int, int] = {}
    acc: dict[int, int] = {}
    for tree, path in rounds:
        for d, node in enumerate(path):
            if tree.children(node):
                tried[d + 1] = tried.get(d + 1, 0) + 1
                if d + 1 < len(path):
                    acc[d + 1] = acc.get(d + 1, 0) + 1
    return [Rate(str(d), acc.get(d, 0), tried[d]) for d in sorted(tried)]


def by_rank(rounds: Iterable[tuple[DraftTree, Sequence[int]]], groups=RANK_GROUPS) -> list[Rate]:
    """Acceptance rate of tried nodes by sibling rank, pooled into `groups` of (first, last) ranks (last None:
    open-ended). Groups nobody reached are left out."""
    tried = [0] * len(groups)
    acc = [0] * len(groups)
    for tree, path in rounds:
        ranks = sibling_ranks(tree)
        for node, ok in tried_nodes(tree, path):
            for g, (lo, hi) in enumerate(groups):
                if ranks[node] >= lo and (hi is None or ranks[node] <= hi):
                    tried[g] += 1
                    acc[g] += ok
                    break
    out = []
    for (lo, hi), a, t in zip(groups, acc, tried):
        if t:
            label = f"rank {lo}" if hi == lo else (f"rank {lo}+" if hi is None else f"ranks {lo}-{hi}")
            out.append(Rate(label, a, t))
    return out


def calibration(rounds: Iterable[tuple[DraftTree, Sequence[int]]], bins: int = 10) -> list[Bin]:
    """Draft per-step probability against the empirical acceptance rate, in `bins` equal-width bins over [0, 1].
    Empty bins are left out. A calibrated drafter has rate == mean_p in every bin."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1; got {bins}")
    count = [0] * bins
    psum = [0.0] * bins
    acc = [0] * bins
    for tree, path in rounds:
        probs = step_probs(tree)
        for node, ok in tried_nodes(tree, path):
            b = min(bins - 1, int(probs[node] * bins))
            count[b] += 1
            psum[b] += probs[node]
            acc[b] += ok
    return [Bin(b / bins, (b + 1) / bins, count[b], psum[b] / count[b], acc[b])
            for b in range(bins) if count[b]]
