"""Prompt-lookup tries merged into a batch of draft trees: pure torch, on the trees' device, no host sync.

The batched form of `WithLookup.draft` = tree.merge([head tree, NgramDrafter trie]) (the host reference), node for
node and in the same order:

1. Matches. seq = history + [anchor]. For n = n_max .. n_min, the (up to) `max_matches` most recent earlier
   occurrences of seq's last n tokens; an occurrence ending at e <= len - 2 continues with seq[e + 1 : e + 1 +
   max_depth]. One row per (n, recency), rows ordered n descending, then most recent first, so the trie's
   insertion order is row-major over the cells [row m, depth k].
2. Trie. Cell (m, k) is the token path cont[m, :k+1]. Its node is created by the first row with the same path; the
   trie keeps the first budget-1 nodes created (the reference stops adding once full), and a node created by an
   n-gram of size n scores its parent's score - 1/n.
3. Union. A trie node whose path is a head-tree node raises that node's score to the better of the two; the others
   become new nodes. The best budget-1 nodes are kept in the order (score descending, depth ascending, head nodes in
   their order before trie nodes in insertion order). The reference also caps every score by its parent's; here
   that is a no-op (both trees' scores fall along every path and both are prefix-closed, so their maximum does too).
Scores are compared in float64, as the reference's Python floats are. Paths are compared exactly (no hashing).
"""
from __future__ import annotations

import torch

from jetflow_sglang.core.tree import check_budget
from jetflow_sglang.core.tree_batch import NEG_INF, TreeBatch


def lookup_rows(seq: torch.Tensor, lens: torch.Tensor, n_max: int, n_min: int, max_depth: int, max_matches: int):
    """seq [b, L]: tokens, real in seq[i, :lens[i]] (the anchor last). Returns cont [b, M, D] continuation tokens,
    valid [b, M, D] (prefix-closed) and the n-gram size of every row [M]; M = (n_max - n_min + 1) *
    min(max_matches, L)."""
    b, length = seq.shape
    dev = seq.device
    pos = torch.arange(length, device=dev)
    back = torch.arange(n_max, device=dev)
    # run[i, e, j]: the j + 1 tokens ending at e equal the j + 1 tokens ending at the anchor
    at = pos[:, None] - back  # [L, n_max]
    same = (seq.gather(1, at.clamp(min=0).view(1, -1).expand(b, -1)).view(b, length, n_max)
            == seq.gather(1, ((lens - 1)[:, None] - back).clamp(min=0))[:, None]) & (at >= 0)
    run = same.to(torch.uint8).cumprod(2).bool() & (back < lens[:, None, None] - 1)  # an n-gram needs n < len
    sizes = torch.arange(n_max, n_min - 1, -1, device=dev)
    hit = run.index_select(2, sizes - 1).transpose(1, 2) & (pos <= lens[:, None, None] - 2)  # [b, N, L]
    k = min(max_matches, length)
    ends = torch.where(hit, pos, -1).topk(k, dim=2).values.view(b, -1)  # most recent first; -1: no match
    at = ends[..., None] + 1 + torch.arange(max_depth, device=dev)  # [b, M, D]
    valid = (ends[..., None] >= 0) & (at < lens[:, None, None])
    cont = seq.gather(1, at.clamp(max=length - 1).view(b, -1)).view(b, -1, max_depth)
    return cont, valid, sizes.repeat_interleave(k).double()


_ONES = 0x0101010101010101  # a word of 8 bool bytes that are all True


def _common(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Length of the common prefix of token rows a and b, [..., P] -> [...] (P a multiple of 8). The bool comparison
    is read as int64 words of 8 bytes, so the length is the count of trailing zero bytes of (word ^ ones): no
    reduction over P. Equal rows: P."""
    words = ((a == b).view(torch.int64) ^ _ONES).unbind(-1)
    out = torch.full((), 8 * len(words), device=a.device)
    for j in range(len(words) - 1, -1, -1):
        w = words[j]
        tz = torch.log2((w & -w).double()).long() // 8 + 8 * j  # the lowest set bit is a byte's bit 0 (< 2**57)
        out = torch.where(w != 0, tz, out)
    return out


def _padded(tokens: torch.Tensor, ok: torch.Tensor, fill) -> torch.Tensor:
    """Tokens [..., D] where `ok`, else `fill` (an int, or a tensor broadcast to [..., 1]), padded with fill to a
    multiple of 8 columns > D (so that every row ends with a fill column)."""
    d = tokens.shape[-1]
    out = torch.where(ok, tokens, fill)
    shape = (*out.shape[:-1], (d // 8 + 1) * 8 - d)
    pad = fill.expand(shape) if isinstance(fill, torch.Tensor) else out.new_full(shape, fill)  # no host copy
    return torch.cat([out, pad], -1)


def _trie(cont, valid, sizes, budget: int):
    """Per cell: the row that creates its trie node [b, M, D], whether the node is kept [b, M, D], its score.

    A cell's node is created by the first row m' whose common prefix with the cell's row is longer than the cell's
    depth."""
    b, m, d = cont.shape
    rows = torch.arange(m, device=cont.device)
    own = _padded(cont, valid, -1 - rows[:, None])  # invalid cells and padding hold their row's own marker
    common = _common(own[:, :, None], own[:, None])  # [b, M, M']
    first = torch.full((b, m, own.shape[-1] + 1), m, dtype=torch.long, device=cont.device)
    first.scatter_reduce_(2, common, rows.expand(b, m, m), "amin")  # the first row with each common length
    creator = first.flip(2).cummin(2).values.flip(2)[:, :, 1:d + 1].clamp(max=m - 1)  # ... with a longer one
    new = valid & (creator == rows[:, None])
    kept = new & (new.view(b, -1).cumsum(1).view(b, m, d) <= budget - 1)
    return creator, kept, (-1.0 / sizes[creator]).cumsum(2)


def _in_tree(tree: TreeBatch, cont, valid):
    """The head-tree node [b, M, D] whose token path is cont[m, :k+1], or -1."""
    b, m, d = cont.shape
    n = tree.budget
    dev = cont.device
    anc, _ = tree.ancestors()  # [b, B, S]: itself, then up to the root
    depth = tree.depths.clamp(max=d + 1)
    cols = torch.arange(d, device=dev)
    up = (depth[..., None] - 1 - cols).clamp(min=0, max=anc.shape[2] - 1)
    path = tree.tokens.gather(1, anc.gather(2, up).view(b, -1)).view(b, n, d)  # [b, B, D]: token at depth j + 1
    common = _common(_padded(cont, valid, -1)[:, :, None], _padded(path, cols < depth[..., None], -2)[:, None])
    real = tree.real() & (tree.depths <= d)
    real[:, 0] = False
    slot = torch.where((common >= depth[:, None]) & real[:, None], torch.arange(n, device=dev), n)  # [b, M, B]
    node = torch.full((b, m, d), n, dtype=torch.long, device=dev)
    node.scatter_reduce_(2, (depth - 1).clamp(min=0, max=d - 1)[:, None].expand(b, m, n), slot, "amin")
    return torch.where(node < n, node, -1)


def merge_lookup(tree: TreeBatch, seq: torch.Tensor, lens: torch.Tensor, budget: int, n_max: int = 4,
                 n_min: int = 1, max_depth: int = 15, max_matches: int = 8) -> TreeBatch:
    """The best `budget` nodes of each greedy head tree united with its request's prompt-lookup trie (module doc).

    seq [b, L] / lens [b]: each request's committed tokens before its anchor (tree.tokens[:, 0]), in seq[i, :lens[i]].
    Returns `budget` slots per request, best-first, in build_topb's layout.
    """
    check_budget(budget)
    b, n_head = tree.tokens.shape
    dev = tree.tokens.device
    root = tree.tokens[:, :1]
    if budget == 1:
        return TreeBatch(root.clone(), tree.parents[:, :1].clone(), tree.depths[:, :1].clone(),
                         tree.logps[:, :1].clone(), torch.ones(b, dtype=torch.long, device=dev), 1)
    lens = lens.to(dev).long()
    full = torch.cat([seq.to(dev).long(), root], 1).scatter_(1, lens[:, None], root)  # history + [anchor]
    cont, valid, sizes = lookup_rows(full, lens + 1, n_max, n_min, max_depth, max_matches)
    creator, kept, cell_score = _trie(cont, valid, sizes, budget)
    node = _in_tree(tree, cont, valid)
    m, d = cont.shape[1:]

    # the union: head slots 0..n_head-1, then one slot per cell (live when it is a kept trie node outside the tree)
    mapped = kept & (node >= 0)
    head_score = torch.where(tree.real(), tree.logps.double(), NEG_INF).scatter_reduce(
        1, node.clamp(min=0).view(b, -1), torch.where(mapped, cell_score, NEG_INF).view(b, -1), "amax")
    cell_slot = n_head + creator * d + torch.arange(d, device=dev)  # the slot of the cell's trie node
    cell_parent = torch.cat([torch.zeros_like(node[:, :, :1]), torch.where(node >= 0, node, cell_slot)[:, :, :-1]], 2)
    parent = torch.cat([tree.parents.clamp(min=0), cell_parent.view(b, -1)], 1)
    score = torch.cat([head_score, torch.where(kept & (node < 0), cell_score, NEG_INF).view(b, -1)], 1)
    depth = torch.cat([tree.depths, (torch.arange(d, device=dev) + 1).repeat(b, m)], 1)
    token = torch.cat([tree.tokens, cont.reshape(b, -1)], 1)
    score[:, 0] = 0.0
    if score.shape[1] < budget:  # fewer union slots than the budget: pad with dead ones
        pad = budget - score.shape[1]
        score = torch.cat([score, score.new_full((b, pad), NEG_INF)], 1)
        parent, depth, token = (torch.cat([t, t.new_zeros(b, pad)], 1) for t in (parent, depth, token))

    # order: score descending, then depth, then union slot (stable sorts from the last key to the first); scores
    # <= 0 as -|s| read as int64 grow with the magnitude (-inf last, -0.0 == 0.0)
    order = depth.sort(dim=1, stable=True).indices
    key = score.abs().neg().view(torch.int64).gather(1, order)
    order = order.gather(1, key.sort(dim=1, stable=True).indices)[:, :budget]
    kept_score = score.gather(1, order)
    real = kept_score > NEG_INF
    place = torch.zeros_like(parent).scatter_(1, order, torch.arange(budget, device=dev).expand(b, -1))
    tokens = torch.where(real, token.gather(1, order), root)
    parents = torch.where(real, place.gather(1, parent.gather(1, order)), 0)
    depths = torch.where(real, depth.gather(1, order), 1)
    parents[:, 0], depths[:, 0] = -1, 0
    return TreeBatch(tokens, parents, depths, torch.where(real, kept_score, NEG_INF).float(), real.sum(1),
                     min(budget - 1, max(tree.depth_bound, d)))
