"""Batched acceptance on the device, in SGLang's verify layout.

Trees arrive as padded tensors (jetflow_sglang.core.tree_batch.TreeBatch fields): tokens/parents/depths [b, n] with
node 0 the root, parents[i] < i, and real nodes i < sizes. Greedy requests keep the deepest path whose every token
is the target's argmax at its parent (core.verify.greedy_accept_batch, the engine's acceptor and tie rule). Sampled requests run recursive rejection sampling with the draft's candidates
as point-mass proposals (a child x is accepted with the residual target probability p(x); on rejection p(x) is
zeroed and p renormalised; if no child is accepted the bonus is drawn from the residual), so every emitted token
follows the target's processed distribution exactly. Padding nodes are never children of anything here.
No host synchronisation: loops run over the static depth and width only, and draws are exponential races (race),
not torch.multinomial.
"""
from __future__ import annotations

import torch

from jetflow_sglang.core.verify import greedy_accept_batch


def _valid(sizes: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=sizes.device)[None] < sizes[:, None]


def race(p: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of p [b, V] (non-negative, any scale) without torch.multinomial, whose kernel reads a count
    back to the host: with E_i ~ Exp(1) independent, the smallest E_i / p_i is index i with probability
    p_i / sum(p) (the minimum of independent exponentials with rates p_i). One argmax on the device."""
    e = torch.empty(p.shape, dtype=torch.float64, device=p.device).exponential_(generator=generator)
    p = p.double()
    return torch.where(p > 0, p / e, torch.full_like(p, -1.0)).argmax(-1)


def sample_path(tokens, parents, sizes, probs, max_depth: int, width: int, generator=None):
    """Recursive rejection sampling; probs [b, n, V] are the target's processed probabilities at every node.
    -> (accepted child per depth [b, max_depth] (-1 after the path ends), bonus [b])."""
    b, n, _ = probs.shape
    dev = probs.device
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
            u = torch.rand(b, generator=generator, dtype=torch.float64, device=dev)
            acc = live & (u < p.gather(1, x)[:, 0])
            chosen = torch.where(acc, kid, chosen)
            rej = (live & ~acc)[:, None]
            zeroed = p.scatter(1, x, 0.0)
            zeroed = zeroed / zeroed.sum(-1, keepdim=True).clamp(min=1e-300)
            p = torch.where(rej, zeroed, p)
        stop = ~done & (chosen < 0)
        draw = race(p, generator)
        bonus = torch.where(stop, draw, bonus)
        done = done | stop
        moved = chosen >= 0
        chosen_by_depth[:, d] = chosen
        cur = torch.where(moved, chosen, cur)
        p = torch.where(moved[:, None], probs[rows, cur].double(), p)
    bonus = torch.where(done, bonus, race(p, generator))
    return chosen_by_depth, bonus


def accept_batch(tree, logits, info, width: int, generator=None):
    """Acceptance for a batch that may mix greedy and sampled requests, on every tree size (one-node trees too).
    tree: a TreeBatch; logits [b*n, V] after penalties and grammar masks; info: SGLang's SamplingBatchInfo (its
    is_all_greedy, temperatures, top_ks, top_ps, min_ps). -> (root-first path [b, depth + 1], -1 padded, bonus [b]).
    Every path holds at least the root, so every request emits at least one token per round."""
    bs, n = tree.tokens.shape
    depth = min(tree.depth_bound, n - 1)  # 0 on a one-node tree: the root alone, then the bonus token
    logits = logits.view(bs, n, -1)
    path, _, g_bonus = greedy_accept_batch(tree, logits.argmax(-1))  # [b, depth + 1]: the engine's acceptor
    if info.is_all_greedy:
        return path, g_bonus
    probs = processed_probs(logits, info)
    chosen, s_bonus = sample_path(tree.tokens, tree.parents, tree.sizes, probs, depth, width, generator)
    s_path = torch.cat([chosen.new_zeros(bs, 1), chosen], 1)  # the root, then the accepted child per depth
    greedy = (info.top_ks.view(-1) == 1).to(path.device)  # SGLang turns temperature 0 into top_k = 1
    return torch.where(greedy[:, None], path, s_path), torch.where(greedy, g_bonus, s_bonus.to(g_bonus.dtype))


def to_sglang(tokens, path, bonus, n: int):
    """SGLang's verify outputs from root-first paths [b, P] (-1 padded) and bonus tokens [b]:
    predict [b*n] int32 (token chosen after each accepted node), accept_index [b, n] int32 (flat node ids, -1 padded),
    accept_lens [b] int32 (accepted nodes incl. the root = tokens emitted), emitted [b, n] (the emitted tokens)."""
    b, width = path.shape
    dev = tokens.device
    if width < n:
        path = torch.cat([path, path.new_full((b, n - width), -1)], 1)
    path = path[:, :n]
    real = path >= 0
    accept_lens = real.sum(1)
    nxt = torch.cat([path[:, 1:], path.new_full((b, 1), -1)], 1)
    nxt_tok = tokens.gather(1, nxt.clamp(min=0))
    is_last = torch.arange(n, device=dev)[None] == (accept_lens - 1)[:, None]
    emitted = torch.where(is_last, bonus[:, None].to(tokens.dtype), nxt_tok)
    emitted = torch.where(real, emitted, torch.zeros_like(emitted))
    predict = torch.zeros(b, n + 1, dtype=torch.int32, device=dev)  # column n takes the padding writes
    predict.scatter_(1, torch.where(real, path, torch.full_like(path, n)), emitted.to(torch.int32))
    base = (torch.arange(b, device=dev) * n)[:, None]
    accept_index = torch.where(real, path + base, torch.full_like(path, -1)).to(torch.int32)
    return predict[:, :n].reshape(-1), accept_index, accept_lens.to(torch.int32), emitted


def processed_probs(logits: torch.Tensor, info) -> torch.Tensor:
    """[b, n, V] logits -> the probabilities SGLang's sampler draws from for each request (temperature, then top-k,
    top-p and min-p over the sorted distribution, as its torch sampler does), per node."""
    b, n, v = logits.shape
    temps = info.temperatures.view(b, 1, 1).float().clamp(min=1e-6)
    probs = (logits.float() / temps).softmax(-1)
    sorted_p, idx = probs.sort(-1, descending=True)
    ranks = torch.arange(v, device=logits.device)[None, None]
    top_k = info.top_ks.view(b, 1, 1).to(logits.device)
    drop = ranks >= torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    cum = sorted_p.cumsum(-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > info.top_ps.view(b, 1, 1).to(logits.device), 0.0)
    if getattr(info, "need_min_p_sampling", False):
        min_p = info.min_ps.view(b, 1, 1).to(logits.device)
        sorted_p = sorted_p.masked_fill(sorted_p < sorted_p[..., :1] * min_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True).clamp(min=1e-30)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
