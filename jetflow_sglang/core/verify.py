"""Acceptance rules: which root-to-node path of a verified tree the target keeps, plus its bonus token.

Greedy keeps the deepest path whose every token is the target's argmax at its parent. Sampling walks the tree with
recursive rejection sampling over each node's children, so the output follows the target's (processed) distribution
exactly whatever the draft proposed.
"""
from __future__ import annotations

import torch

from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.core.tree_batch import TreeBatch


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


def greedy_accept_batch(tb: TreeBatch, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """greedy_accept for a batch, on the trees' device without a host sync.

    argmax [b, B]: the target's argmax at every slot. Returns accept_index [b, Dmax+1] (accepted node ids, root first,
    -1 padded; Dmax = min(tb.depth_bound, B - 1)), accept_len [b] (accepted nodes, root included) and bonus [b] (the target's token
    after the last accepted node). Ties between equal-token siblings go to the smaller node id, as in greedy_accept.
    """
    b, n = tb.tokens.shape
    dev = tb.tokens.device
    dmax = min(tb.depth_bound, n - 1)
    argmax = argmax.to(dev).long()
    up = tb.parents.clamp(min=0)
    hit = (tb.tokens == argmax.gather(1, up)) & tb.real()
    hit[:, 0] = True
    ok = hit.clone()
    for _ in range(dmax):  # ok[v]: every node on the path root..v matches its parent's argmax
        ok = hit & ok.gather(1, up)
    # the deepest accepted node; equal depths (duplicate siblings) go to the first path greedy_accept would walk
    first = _first_child_path(tb, ok, dmax)
    key = torch.where(first, tb.depths * (n + 1) + (n - torch.arange(n, device=dev)), -1)
    last = key.argmax(1, keepdim=True)
    depth = tb.depths.gather(1, last)
    index = torch.full((b, dmax + 2), -1, dtype=torch.long, device=dev)
    cur = last
    for step in range(dmax + 1):
        d = tb.depths.gather(1, cur)
        index.scatter_(1, torch.where(step <= depth, d, dmax + 1), cur)
        cur = up.gather(1, cur)
    return index[:, :dmax + 1], (depth + 1).view(b), argmax.gather(1, last).view(b)


def _first_child_path(tb: TreeBatch, ok: torch.Tensor, dmax: int) -> torch.Tensor:
    """Accepted nodes that are the first accepted child of an accepted parent (then along the whole path)."""
    b, n = ok.shape
    dev = ok.device
    up = tb.parents.clamp(min=0)
    ids = torch.arange(n, device=dev).expand(b, n)
    best = torch.full((b, n + 1), n, dtype=torch.long, device=dev)  # smallest accepted child id per parent
    best.scatter_reduce_(1, torch.where(ok & (ids > 0), up, n), ids, reduce="amin")
    first = ok & (best.gather(1, up) == ids)
    first[:, 0] = True
    chain = first.clone()
    for _ in range(dmax):
        chain = first & chain.gather(1, up)
    return chain


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


def _valid(sizes: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=sizes.device)[None] < sizes[:, None]


def race(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """One draw per row of p [b, V] (non-negative, any scale) without torch.multinomial, whose kernel reads a count
    back to the host: with e_i ~ Exp(1) independent ([b, V], float64), the smallest e_i / p_i is index i with
    probability p_i / sum(p) (the minimum of independent exponentials with rates p_i). One argmax on the device."""
    p = p.double()
    return torch.where(p > 0, p / e, torch.full_like(p, -1.0)).argmax(-1)


def accept_noise(b: int, vocab: int, max_depth: int, width: int, device, generator=None):
    """The random draws of one sample_accept_batch call, made before it (a captured acceptance takes them as
    inputs): uniforms [b, max_depth, width] for the children's tests and exponentials [b, max_depth + 1, V] for the
    races, float64."""
    u = torch.rand(b, max_depth, width, generator=generator, dtype=torch.float64, device=device)
    e = torch.empty(b, max_depth + 1, vocab, dtype=torch.float64, device=device).exponential_(generator=generator)
    return u, e


def sample_accept_batch(tokens, parents, sizes, probs, max_depth: int, width: int, generator=None, noise=None):
    """sample_accept for a padded batch of trees (TreeBatch fields), on the device and without a host sync: loops run
    over the static depth and width (each node's first `width` children, in slot order) and draws are exponential
    races, not torch.multinomial. Candidates are point-mass proposals. probs [b, n, V]: the target's processed
    probabilities at every node; noise: accept_noise's draws (default: drawn here from `generator`).
    -> (accepted child per depth [b, max_depth] (-1 after the path ends), bonus [b])."""
    b, n, v = probs.shape
    dev = probs.device
    u_all, e_all = accept_noise(b, v, max_depth, width, dev, generator) if noise is None else noise
    rows = torch.arange(b, device=dev)
    ar = torch.arange(n, device=dev)
    valid = _valid(sizes, n)
    valid[:, 0] = False  # the root is nobody's child
    child_of = (parents[:, None, :] == ar[None, :, None]) & valid[:, None, :]  # [b, parent, child]
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    bonus = torch.zeros(b, dtype=torch.long, device=dev)
    chosen_by_depth = torch.full((b, max_depth), -1, dtype=torch.long, device=dev)
    p = probs[:, 0].double()
    for d in range(max_depth):
        kids = torch.where(child_of[rows, cur], ar[None], torch.full_like(ar, n)[None]).sort(1).values[:, :width]
        chosen = torch.full((b,), -1, dtype=torch.long, device=dev)
        for j in range(kids.shape[1]):
            kid = kids[:, j]
            live = (kid < n) & ~done & (chosen < 0)
            x = tokens.gather(1, kid.clamp(max=n - 1)[:, None])
            u = u_all[:, d, j]
            acc = live & (u < p.gather(1, x)[:, 0])
            chosen = torch.where(acc, kid, chosen)
            rej = (live & ~acc)[:, None]
            zeroed = p.scatter(1, x, 0.0)
            zeroed = zeroed / zeroed.sum(-1, keepdim=True).clamp(min=1e-300)
            p = torch.where(rej, zeroed, p)
        stop = ~done & (chosen < 0)
        draw = race(p, e_all[:, d])
        bonus = torch.where(stop, draw, bonus)
        done = done | stop
        moved = chosen >= 0
        chosen_by_depth[:, d] = chosen
        cur = torch.where(moved, chosen, cur)
        p = torch.where(moved[:, None], probs[rows, cur].double(), p)
    bonus = torch.where(done, bonus, race(p, e_all[:, max_depth]))
    return chosen_by_depth, bonus
