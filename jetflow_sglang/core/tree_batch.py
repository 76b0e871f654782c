"""Batched, vectorized, exact top-B draft trees: pure torch, on the candidates' device, no host sync.

A tree of budget B holds the root (the anchor) and the B-1 best non-root nodes by cumulative draft log-prob. A node's
rank is its place among its parent's W candidates (sorted by descending log-prob). The fixed total order ("tie rule"):

    score descending, then depth ascending, then (within a depth) the parent's place in this order, then rank.

`tree.best_first(eager=False)` follows the same rule, so both pick the same nodes in the same order. Because
log-probs are <= 0, a parent and an elder sibling always come strictly before a node, so the top B-1 nodes are prefix-
and sibling-closed. That makes a level-by-level expansion exact: the top nodes at depth d have their parents among the
kept nodes at depth d-1, so keeping the best B-d nodes per depth (candidates = kept parents x W children) and then the
best B-1 over the union of depths gives the exact top B-1. Ties are exact too: scores are compared as float32 keys
made unique by their place in the order (no float tie is left to topk). A reference summing in float64 agrees whenever
the sums are exact (e.g. log-probs on a 2^-10 grid). Candidates with log-prob -inf never become nodes. With per-depth
marginals a level only looks at candidates (m, r) (parent place m, rank r, from 0) with (m+1)(r+1) <= kept, since
(m+1)(r+1)-1 candidates come before such a candidate, and that also fit in the tree with the parents 0..m and the
fewest ancestors those parents can have (see _pruned; about a quarter fewer candidates at B=256).

Output nodes are ordered best-first (the order above), so parents come before children and the first b nodes of a
budget-B tree are the budget-b tree (what `budget.AdaptiveBudget` relies on).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from jetflow_sglang.core.tree import DraftTree, check_budget, words_for

NEG_INF = float("-inf")


@dataclass
class TreeBatch:
    """b padded trees of B slots. Padding slots: token = root token, parent 0, depth 1, logp -inf.

    max_depth: static upper bound on node depth (a Python int, known without a host sync); 0 = unknown (B - 1).
    """
    tokens: torch.Tensor   # long [b, B], node 0 = root (anchor)
    parents: torch.Tensor  # long [b, B], -1 at the root
    depths: torch.Tensor   # long [b, B]
    logps: torch.Tensor    # float [b, B], cumulative draft log-prob (root 0, padding -inf)
    sizes: torch.Tensor    # long [b], real nodes (root counted)
    max_depth: int = 0

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    @property
    def depth_bound(self) -> int:
        return self.max_depth if self.max_depth > 0 else max(1, self.budget - 1)

    def real(self) -> torch.Tensor:
        """Bool [b, B]: the slot holds a real node."""
        return torch.arange(self.budget, device=self.tokens.device)[None] < self.sizes[:, None]

    def ancestors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Long [b, B, Dmax+1]: node i's ancestors (itself first, then up to the root; repeats the root after it) and
        bool [b, B, Dmax+1]: the entry is a distinct ancestor (step <= depth)."""
        b, n = self.tokens.shape
        dev = self.tokens.device
        up = self.parents.clamp(min=0)  # the root points at itself
        steps = min(self.depth_bound, n - 1) + 1
        anc = torch.stack([torch.arange(n, device=dev).expand(b, n), up], 2)[:, :, :steps]
        while anc.shape[2] < steps:  # pointer doubling: the (s + L)-th ancestor is the L-th ancestor's s-th
            jump = anc[:, :, -1]  # the (L - 1)-th ancestor ... composed with `up` gives L
            far = up.gather(1, jump)  # the L-th ancestor of every node
            anc = torch.cat([anc, far.gather(1, anc.reshape(b, -1)).view(b, n, -1)], 2)[:, :, :steps]
        valid = torch.arange(anc.shape[2], device=dev) <= self.depths[..., None]
        return anc, valid

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [b, B, B]: row i is True at j when j is an ancestor of i or i itself (padding rows: root + self)."""
        b, n = self.tokens.shape
        anc, _ = self.ancestors()
        return torch.zeros(b, n, n, dtype=torch.bool, device=anc.device).scatter_(2, anc, True)

    def packed_mask(self, words: int | None = None) -> torch.Tensor:
        """Int32 [b, B, words]: bit j%32 of word j//32 holds column j (the layout of tree.pack_bits)."""
        n = self.budget
        words = words_for(n) if words is None else words
        if words < words_for(n):
            raise ValueError(f"{n} columns need {words_for(n)} words, got {words}")
        anc, valid = self.ancestors()
        bit = torch.where(valid, torch.ones_like(anc) << (anc % 32), 0)  # distinct ancestors: the sum is an OR
        packed = torch.zeros(*anc.shape[:2], words, dtype=torch.int64, device=anc.device)
        packed.scatter_add_(2, anc // 32, bit)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def tree(self, i: int) -> DraftTree:
        """Host copy of request i (real nodes only)."""
        n = int(self.sizes[i])
        return DraftTree(tokens=self.tokens[i, :n].tolist(), parents=self.parents[i, :n].tolist(),
                         depths=self.depths[i, :n].tolist(), logps=self.logps[i, :n].double().tolist())

    def trees(self) -> list[DraftTree]:
        return [self.tree(i) for i in range(self.batch)]

    @staticmethod
    def from_trees(trees: Sequence[DraftTree], budget: int | None = None, device=None) -> "TreeBatch":
        """Pad host trees into a batch (budget >= the largest tree)."""
        n = max(len(t) for t in trees) if budget is None else budget
        if any(len(t) > n for t in trees):
            raise ValueError(f"a tree has more than {n} nodes")
        b = len(trees)
        tokens = torch.tensor([[t.tokens[0]] * n for t in trees], dtype=torch.long)
        parents = torch.zeros(b, n, dtype=torch.long)
        depths = torch.ones(b, n, dtype=torch.long)
        logps = torch.full((b, n), NEG_INF)
        for i, t in enumerate(trees):
            m = len(t)
            tokens[i, :m] = torch.tensor(t.tokens)
            parents[i, :m] = torch.tensor(t.parents)
            depths[i, :m] = torch.tensor(t.depths)
            logps[i, :m] = torch.tensor(t.logps, dtype=torch.float32)
        sizes = torch.tensor([len(t) for t in trees], dtype=torch.long)
        max_depth = max(max(t.depths) for t in trees)
        out = TreeBatch(tokens, parents, depths, logps, sizes, max(1, max_depth))
        return out if device is None else out.to(device)

    def to(self, device) -> "TreeBatch":
        return TreeBatch(self.tokens.to(device), self.parents.to(device), self.depths.to(device),
                         self.logps.to(device), self.sizes.to(device), self.max_depth)


def pack_bits_batch(mask: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """Bool [..., C] -> int32 [..., words] on the mask's device, little-endian bits inside each word."""
    cols = mask.shape[-1]
    words = words_for(cols) if words is None else words
    if words < words_for(cols):
        raise ValueError(f"{cols} columns need {words_for(cols)} words, got {words}")
    bits = torch.zeros(*mask.shape[:-1], words * 32, dtype=torch.int64, device=mask.device)
    bits[..., :cols] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (bits.view(*mask.shape[:-1], words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _nonpositive(lp: torch.Tensor) -> torch.Tensor:
    """-|lp| in float32: every value has its sign bit set (0 becomes -0.0), so sums of them do too."""
    return lp.float().abs().neg()


def _order_key(scores: torch.Tensor, tie: torch.Tensor, bits: int) -> torch.Tensor:
    """Int64 keys, smallest first = score descending then `tie` ascending (tie: int64, 0 <= tie < 2**bits).

    Scores carry their sign bit (see _nonpositive), so their int32 bit patterns grow with the magnitude; times 2**bits
    plus the tie, every key is unique and topk(largest=False) has no ties to break (int64 topk is also the fastest).
    """
    return torch.add(tie, scores.view(torch.int32).long(), alpha=1 << bits)


def _bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


@dataclass(frozen=True)
class _Level:
    start: int  # this level's candidates in the plan's concatenated candidate list
    end: int
    keep: int
    bits: int
    m_idx: torch.Tensor  # [n] parent place of each candidate
    tie: torch.Tensor    # [n] int64 place of each candidate in the tie order (m * W + r)


@dataclass(frozen=True)
class _Plan:
    levels: tuple[_Level, ...]
    rank_flat: torch.Tensor  # [n_all] (depth - 1) * W + rank of every candidate: its log-prob/token column
    parent_u: torch.Tensor   # [n_all] union index of the candidate's parent (-1: the root)
    base: torch.Tensor       # [U] start of the level of each union slot, in the candidate list
    u_depth: torch.Tensor    # [U]
    u_tie: torch.Tensor      # [U] 0..U-1
    u_bits: int


def _depth_bound(k: int, d: int, width: int) -> int:
    """The most depth-d nodes a top-k tree can hold: p of them need at least ceil(p / W^j) ancestors at depth d - j."""
    def need(p: int) -> int:
        return p + sum(-(-p // width ** j) for j in range(1, d))
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= k else (lo, mid - 1)
    return lo


@functools.lru_cache(maxsize=256)
def _plan(budget: int, depth: int, width: int, device: str) -> _Plan:
    """The static shape of a per-depth build: which candidates each level looks at (pruned) and how many it keeps."""
    levels, rank_flat, parent_u, base, u_depth = [], [], [], [], []
    k_prev, start, off_prev, off = 1, 0, -1, 0
    for d in range(1, depth + 1):
        keep = min(_depth_bound(budget - 1, d, width), k_prev * width)
        if keep <= 0:
            break
        m_idx, r_idx = _pruned(k_prev, width, keep, device, budget - 1, d)
        n = m_idx.shape[0]
        keep = min(keep, n)  # every depth-d node of the tree is a candidate, so it has at most n of them
        levels.append(_Level(start, start + n, keep, _bits(k_prev * width), m_idx, m_idx * width + r_idx))
        rank_flat.append((d - 1) * width + r_idx)
        parent_u.append(m_idx + off_prev if d > 1 else torch.full_like(m_idx, -1))
        base += [start] * keep
        u_depth += [d] * keep
        k_prev, start, off_prev, off = keep, start + n, off, off + keep
    dev = torch.device(device)
    cat = (lambda xs: torch.cat(xs)) if levels else (lambda xs: torch.zeros(0, dtype=torch.long, device=dev))
    return _Plan(tuple(levels), cat(rank_flat), cat(parent_u), torch.tensor(base, dtype=torch.long, device=dev),
                 torch.tensor(u_depth, dtype=torch.long, device=dev), torch.arange(off, device=dev),
                 _bits(max(off, 1)))


def _pruned(k_prev: int, width: int, keep: int, device: str, nodes: int = 0, depth: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Static candidate list of one level: (parent position m, rank r) that can be in the tree.

    With per-depth marginals (every parent shares the candidate row), the candidate (m, r) comes after every
    (m' <= m, r' <= r) at its depth, after the parents 0..m and after their ancestors (at least ceil((m+1) / W^(j-1))
    nodes at depth d-j). So it is among the level's `keep` best only when (m + 1) * (r + 1) <= keep, and among the
    tree's `nodes` non-root nodes only when (m + 1) * (r + 1) + sum_j ceil((m+1) / W^(j-1)) <= nodes (nodes = 0: no
    such bound). Conditioned trees pass keep = k_prev * width (no pruning). Returns parent positions and ranks, [n].
    """
    def before(m: int) -> int:  # the parents 0..m and the fewest ancestors they can have
        return sum(-(-(m + 1) // width ** (j - 1)) for j in range(1, depth))
    pairs = [(m, r) for m in range(k_prev) for r in range(width)
             if (m + 1) * (r + 1) <= keep and (not nodes or (m + 1) * (r + 1) + before(m) <= nodes)]
    m, r = zip(*pairs)
    return torch.tensor(m, device=device), torch.tensor(r, device=device)


def _expand(anchor, tok_table, lp_table, root_row, child_rows, budget: int, depth: int) -> TreeBatch:
    """Level-by-level exact top-(budget-1) over a candidate table.

    tok_table/lp_table [b, R, W]: the candidate children of a node whose table row is r. root_row [b]: the root's row.
    child_rows(parent_rows [b, k], ranks [b, k], depth d of the children) -> the children's rows [b, k].
    No pruning (parents do not share candidates), so this is slower than build_topb's planned path. Each level keeps its nodes in the within-depth tie order (score desc, parent position asc, rank asc).
    """
    b, n_rows, width = tok_table.shape
    dev = tok_table.device
    k_max = budget - 1
    lvl_scores, lvl_flat, lvl_parent_u, lvl_depth = [], [], [], []
    score = torch.full((b, 1), -0.0, device=dev)
    rows = root_row.view(b, 1)
    offset_prev = -1  # union index of the previous level's first node (-1: the root)
    offset = 0
    lp_flat = lp_table.reshape(b, n_rows * width)
    for d in range(1, depth + 1 if k_max > 0 else 1):
        k_prev = score.shape[1]
        keep = min(k_max - (d - 1), k_prev * width)  # a depth-d node needs d-1 kept ancestors
        if keep <= 0:
            break
        m_idx, r_idx = _pruned(k_prev, width, k_prev * width, str(dev))
        flat = rows.index_select(1, m_idx) * width + r_idx  # the candidate's (parent row, rank) in the table
        cand = score.index_select(1, m_idx) + lp_flat.gather(1, flat)
        sel = _order_key(cand, m_idx * width + r_idx, _bits(k_prev * width)).topk(keep, dim=1, largest=False).indices
        parent_local = m_idx[sel]
        score = cand.gather(1, sel)
        flat = flat.gather(1, sel)
        lvl_scores.append(score)
        lvl_flat.append(flat)
        lvl_parent_u.append(parent_local + offset_prev if d > 1 else torch.full_like(sel, -1))
        lvl_depth.append(torch.full((keep,), d, dtype=torch.long, device=dev))
        if d < depth:
            parent_rows = rows.gather(1, parent_local)
            rows = child_rows(parent_rows, r_idx[sel], d)
        offset_prev, offset = offset, offset + keep
    return _assemble(anchor, tok_table, lvl_scores, lvl_flat, lvl_parent_u, lvl_depth, budget)


def _assemble(anchor, tok_table, lvl_scores, lvl_flat, lvl_parent_u, lvl_depth, budget: int) -> TreeBatch:
    if not lvl_scores:
        return root_only(anchor, budget)
    b = anchor.shape[0]
    u_scores = torch.cat(lvl_scores, 1)  # the union in (depth, within-depth) order: the tie order
    n_union = u_scores.shape[1]
    tie = torch.arange(n_union, device=anchor.device)
    return _select(anchor, tok_table.reshape(b, -1), u_scores, torch.cat(lvl_flat, 1), torch.cat(lvl_parent_u, 1),
                   torch.cat(lvl_depth), tie, _bits(n_union), budget, len(lvl_scores))


def _check_inputs(anchor, tokens, logps, budget):
    check_budget(budget)
    if tokens.dim() != 3 or tokens.shape != logps.shape:
        raise ValueError(f"candidates must be [b, D, W] tokens and log-probs; got {tuple(tokens.shape)} and {tuple(logps.shape)}")
    if anchor.dim() != 1 or anchor.shape[0] != tokens.shape[0]:
        raise ValueError(f"anchor must be [b] with b = {tokens.shape[0]}; got {tuple(anchor.shape)}")


def build_topb(anchor: torch.Tensor, cand_tokens: torch.Tensor, cand_logps: torch.Tensor, budget: int) -> TreeBatch:
    """Exact top-(budget-1) trees over per-depth marginals (= tree.best_first(eager=False) with per_depth).

    anchor [b]; cand_tokens/cand_logps [b, D, W]: the W candidates at depth d+1 (the same for every parent at depth
    d), log-probs (<= 0; lp is read as -|lp|) sorted descending along W. Returns `budget` slots per request,
    best-first; tie rule in the module doc. A few dozen small torch ops per level, no host sync.
    """
    _check_inputs(anchor, cand_tokens, cand_logps, budget)
    b, depth, width = cand_tokens.shape
    dev = cand_tokens.device
    plan = _plan(budget, depth, width, str(dev))
    if not plan.levels:
        return root_only(anchor, budget)
    lp_all = _nonpositive(cand_logps.reshape(b, depth * width)).index_select(1, plan.rank_flat)
    score = torch.full((b, 1), -0.0, device=dev)
    sels, scores = [], []
    for lv in plan.levels:
        cand = score.index_select(1, lv.m_idx) + lp_all[:, lv.start:lv.end]
        sel = _order_key(cand, lv.tie, lv.bits).topk(lv.keep, dim=1, largest=False).indices
        score = cand.gather(1, sel)
        sels.append(sel)
        scores.append(score)
    cand_of_u = torch.cat(sels, 1) + plan.base  # union slot -> its candidate in the plan's list
    u_scores = torch.cat(scores, 1)
    n_all = plan.rank_flat.shape[0]
    u_flat = plan.rank_flat.expand(b, n_all).gather(1, cand_of_u)
    u_parent = plan.parent_u.expand(b, n_all).gather(1, cand_of_u)
    return _select(anchor, cand_tokens.reshape(b, -1), u_scores, u_flat, u_parent, plan.u_depth, plan.u_tie,
                   plan.u_bits, budget, len(plan.levels))


def topb_depth(budget: int, depth: int, width: int, device) -> int:
    """build_topb's max_depth for candidates [b, depth, width] (static: its plan's levels), for a caller that runs
    it captured and rebuilds the TreeBatch from the tensors."""
    return max(1, len(_plan(budget, depth, width, str(device)).levels))


def root_only(anchor: torch.Tensor, budget: int) -> TreeBatch:
    """Trees holding only their root (anchor [b]), padded to `budget` slots."""
    b, dev = anchor.shape[0], anchor.device
    tokens = anchor.view(b, 1).expand(b, budget).clone()
    parents = torch.zeros(b, budget, dtype=torch.long, device=dev)
    depths = torch.ones(b, budget, dtype=torch.long, device=dev)
    logps = torch.full((b, budget), NEG_INF, device=dev)
    parents[:, 0], depths[:, 0], logps[:, 0] = -1, 0, 0.0
    return TreeBatch(tokens, parents, depths, logps, torch.ones(b, dtype=torch.long, device=dev), 1)


def _select(anchor, tok_flat, u_scores, u_flat, u_parent, u_depth, u_tie, u_bits: int, budget: int,
            max_depth: int) -> TreeBatch:
    """The best budget-1 nodes of the union of levels, best-first, as padded trees."""
    b, n_union = u_scores.shape
    dev = anchor.device
    k = min(budget - 1, n_union)
    out = root_only(anchor, budget)
    sel = _order_key(u_scores, u_tie, u_bits).topk(k, dim=1, largest=False).indices
    sel_scores = u_scores.gather(1, sel)
    out_pos = torch.zeros(b, n_union + 1, dtype=torch.long, device=dev)  # [:, 0] is the root
    out_pos.scatter_(1, sel + 1, torch.arange(1, k + 1, device=dev).expand(b, k))
    real = sel_scores > NEG_INF
    out.tokens[:, 1:k + 1] = torch.where(real, tok_flat.gather(1, u_flat.gather(1, sel)), out.tokens[:, 1:k + 1])
    out.parents[:, 1:k + 1] = torch.where(real, out_pos.gather(1, u_parent.gather(1, sel) + 1), 0)
    out.depths[:, 1:k + 1] = torch.where(real, u_depth.expand(b, n_union).gather(1, sel), 1)
    out.logps[:, 1:k + 1] = torch.where(real, sel_scores, NEG_INF)
    return TreeBatch(out.tokens, out.parents, out.depths, out.logps, 1 + real.sum(1), max_depth)


def build_topb_conditioned(first: TreeBatch, child_tokens: torch.Tensor, child_logps: torch.Tensor,
                           cand_tokens: torch.Tensor, cand_logps: torch.Tensor, budget: int) -> TreeBatch:
    """Exact top-(budget-1) trees with branch conditioning (the rebuild pass of `jetflow-branch`).

    first: the pass-1 trees (N slots); child_tokens/child_logps [b, N, W]: the top-W children of every pass-1 node given
    its real ancestors (sorted descending; padding rows are ignored); cand_tokens/cand_logps [b, D, W]: the per-depth
    marginals. A node whose token path is a real pass-1 node v takes its children from row v; any other node (a path
    pass 1 never saw) falls back to the marginals of its depth. Same tie rule and output order as build_topb.
    """
    _check_inputs(first.tokens[:, 0], cand_tokens, cand_logps, budget)
    b, n, width = child_tokens.shape
    depth = cand_tokens.shape[1]
    if n != first.budget or child_logps.shape != child_tokens.shape or cand_tokens.shape[2] != width:
        raise ValueError("conditioned candidates must be [b, N, W] for pass-1 trees of N slots, with the marginals' W")
    dev = child_tokens.device
    real = first.real()
    # match[b, v*W + r] = the pass-1 child of v whose token is child_tokens[v, r], or the marginal row of its depth.
    par = first.parents.clamp(min=0)
    hit = (child_tokens.gather(1, par[..., None].expand(b, n, width)) == first.tokens[..., None]) & real[..., None]
    hit[:, 0] = False  # the root is nobody's child
    rank = hit.float().argmax(-1)
    found = hit.any(-1)
    match = torch.full((b, n * width + 1), -1, dtype=torch.long, device=dev)
    slot = torch.where(found, par * width + rank, n * width)
    match.scatter_(1, slot, torch.arange(n, device=dev).expand(b, n))
    match = match[:, :-1]
    tok_table = torch.cat([child_tokens, cand_tokens], 1)
    lp_table = _nonpositive(torch.cat([child_logps.float(), cand_logps.float()], 1))

    def child_rows(parent_rows, ranks, d):
        marginal = n + min(d, depth - 1)
        known = parent_rows < n
        m = match.gather(1, torch.where(known, parent_rows, 0) * width + ranks)
        return torch.where(known & (m >= 0), m, marginal)

    root_row = torch.zeros(b, dtype=torch.long, device=dev)
    return _expand(first.tokens[:, 0], tok_table, lp_table, root_row, child_rows, budget, depth)
