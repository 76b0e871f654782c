"""Draft trees: structure, best-first construction and ancestor masks.

This module imports no model code; the head, verification, kernels and the SGLang worker all build on it.
Node 0 is the root (the anchor: the last committed token, not yet in the target's KV cache). Nodes are
stored parent-before-child, so `parents[i] < i` for every non-root node.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

MIN_BUDGET, MAX_BUDGET = 1, 512


def check_budget(budget: int) -> int:
    if not isinstance(budget, int) or isinstance(budget, bool) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be an integer in [{MIN_BUDGET}, {MAX_BUDGET}] (nodes, root included); got {budget!r}")
    return budget


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    logps: list[float]  # cumulative draft log-prob of the path root..node (root = 0)
    # child_probs[i]: the draft distribution (1-D probs over the target vocab) node i's children were drawn
    # from. Only sampled (temperature > 0) trees need it; several nodes may share one tensor.
    child_probs: list[torch.Tensor | None] | None = None
    _children: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.tokens]
            for node, parent in enumerate(self.parents):
                if parent >= 0:
                    kids[parent].append(node)
            self._children = kids
        return self._children[i]

    def path_to(self, i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def add(self, token: int, parent: int, logp: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.logps.append(float(logp))
        self._children = None
        return len(self.tokens) - 1

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)

    def packed_mask(self, words: int | None = None) -> torch.Tensor:
        return pack_bits(self.ancestor_mask(), words)

    @staticmethod
    def root(token: int) -> "DraftTree":
        return DraftTree(tokens=[int(token)], parents=[-1], depths=[0], logps=[0.0])


# Child proposals of a node: (tokens, log-probs), sorted by descending log-prob.
ChildFn = Callable[[DraftTree, int], tuple[Sequence[int], Sequence[float]]]


def best_first(root_token: int, child_fn: ChildFn, budget: int, width: int, max_depth: int,
               eager: bool = False) -> DraftTree:
    """Grow a tree on cumulative draft log-prob until it holds `budget` nodes (root counted).

    eager=False takes, one at a time, the best candidate whose parent is already in the tree, so the result is
    the `budget` best prefix-closed paths. Ties follow the fixed rule of tree_batch.build_topb: score descending,
    then depth ascending, then the parent's place among the nodes of its depth (in this order), then rank.
    Candidates with log-prob -inf are never added.
    eager=True is the paper's accum_logp: popping a node adds all of its (up to `width`) children at once.
    """
    check_budget(budget)
    tree = DraftTree.root(root_token)
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, depth, parent's place in its depth, rank, parent)
    cands: dict[int, tuple[Sequence[int], Sequence[float]]] = {}
    place = [0]  # each node's place among the nodes of its depth, in pop order
    per_depth_count: dict[int, int] = {}

    def offer(parent: int, rank: int) -> None:
        if tree.depths[parent] >= max_depth or rank >= width:
            return
        if parent not in cands:
            cands[parent] = child_fn(tree, parent)
        toks, lps = cands[parent]
        if rank < len(toks) and float(lps[rank]) > float("-inf"):
            heapq.heappush(heap, (-(tree.logps[parent] + float(lps[rank])), tree.depths[parent] + 1, place[parent],
                                  rank, parent))

    if eager:
        frontier = [(0.0, 0, 0)]
        while frontier and len(tree) < budget:
            _, _, node = heapq.heappop(frontier)
            if tree.depths[node] >= max_depth:
                continue
            toks, lps = child_fn(tree, node)
            for tok, lp in list(zip(toks, lps))[: min(width, budget - len(tree))]:
                child = tree.add(tok, node, tree.logps[node] + float(lp))
                heapq.heappush(frontier, (-tree.logps[child], child, child))
        return tree

    offer(0, 0)
    while heap and len(tree) < budget:
        _, depth, _, rank, parent = heapq.heappop(heap)
        toks, lps = cands[parent]
        child = tree.add(toks[rank], parent, tree.logps[parent] + float(lps[rank]))
        place.append(per_depth_count.get(depth, 0))
        per_depth_count[depth] = place[-1] + 1
        offer(parent, rank + 1)
        offer(child, 0)
    return tree


def per_depth(cand_tokens: Sequence[Sequence[int]], cand_logps: Sequence[Sequence[float]]) -> ChildFn:
    """Child proposals shared by every parent at a depth: the branch-agnostic per-depth marginals."""
    return lambda tree, node: (cand_tokens[tree.depths[node]], cand_logps[tree.depths[node]])


def chain(root_token: int, tokens: Sequence[int], logps: Sequence[float] | None = None) -> DraftTree:
    tree = DraftTree.root(root_token)
    for i, tok in enumerate(tokens):
        tree.add(tok, i, tree.logps[i] + (float(logps[i]) if logps is not None else 0.0))
    return tree


def merge(trees: Sequence[DraftTree], budget: int) -> DraftTree:
    """The best `budget` nodes (root counted) of the union of trees that share a root, as one best-first tree.

    A node is its token path. A path found in several trees takes its best score (each tree's `logps`: a cumulative
    log-prob, or a drafter's pseudo log-prob), then every score is capped by its parent's, so a parent always ranks
    before its children. Order: score descending, depth ascending, then first seen (earlier trees win ties). The
    first b nodes of the result are therefore the best b of the union, and the tree is prefix-closed. Paths with
    score -inf are dropped. Only greedy (unsampled) trees merge: sampled trees carry their draw distributions.
    """
    check_budget(budget)
    if not trees or len({t.tokens[0] for t in trees}) != 1:
        raise ValueError("merge needs at least one tree, and every tree must have the same root token")
    if any(t.child_probs is not None for t in trees):
        raise ValueError("sampled trees (with child_probs) cannot be merged: their draws would no longer match q")
    index: dict[tuple[int, int], int] = {}  # (union parent, token) -> union node
    tok, par, dep, score = [trees[0].tokens[0]], [-1], [0], [0.0]
    for t in trees:
        local = [0] * len(t)
        for v in range(1, len(t)):
            key = (local[t.parents[v]], t.tokens[v])
            u = index.get(key)
            if u is None:
                u = index[key] = len(tok)
                tok.append(t.tokens[v]), par.append(key[0]), dep.append(dep[key[0]] + 1), score.append(t.logps[v])
            else:
                score[u] = max(score[u], t.logps[v])
            local[v] = u
    for u in range(1, len(tok)):  # parents come first, so one pass caps every path
        score[u] = min(score[u], score[par[u]])
    order = sorted((u for u in range(1, len(tok)) if score[u] > float("-inf")), key=lambda u: (-score[u], dep[u], u))
    out, new = DraftTree.root(tok[0]), {0: 0}
    for u in order[: budget - 1]:
        new[u] = out.add(tok[u], new[par[u]], score[u])
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool [N, N]: row i is True at j when j is an ancestor of i or j == i."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: nodes must come after their parent")
        mask[i] |= mask[p]
    return mask


def words_for(n: int) -> int:
    return (n + 31) // 32


def pack_bits(mask: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """Bool [R, C] -> int32 [R, words]; bit j%32 of word j//32 holds column j (little-endian)."""
    rows, cols = mask.shape
    words = words_for(cols) if words is None else words
    if words < words_for(cols):
        raise ValueError(f"{cols} columns need {words_for(cols)} words, got {words}")
    bits = torch.zeros(rows, words * 32, dtype=torch.int64, device=mask.device)  # on the mask's device: no sync
    bits[:, :cols] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (bits.view(rows, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(words: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int64)
    bits = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :cols].bool()


def pack_ragged(parent_lists: Sequence[Sequence[int]], words: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ancestor rows of several trees, stacked by `qo_indptr` (rows of tree b at indptr[b]:indptr[b+1])."""
    sizes = [len(p) for p in parent_lists]
    words = words_for(max(sizes, default=1)) if words is None else words
    rows = [pack_bits(ancestor_mask(p), words) for p in parent_lists]
    indptr = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(sizes, dtype=torch.int32).cumsum(0)
    return (torch.cat(rows) if rows else torch.zeros(0, words, dtype=torch.int32)), indptr
