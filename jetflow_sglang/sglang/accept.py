"""Batched acceptance on the device, in SGLang's verify layout.

Trees arrive as padded tensors (jetflow_sglang.core.tree_batch.TreeBatch fields): tokens/parents/depths [b, n] with
node 0 the root, parents[i] < i, and real nodes i < sizes. Greedy requests keep the deepest path whose every token
is the target's argmax at its parent (core.verify.greedy_accept_batch, the engine's acceptor and tie rule). Sampled requests run recursive rejection sampling with the draft's candidates
as point-mass proposals (a child x is accepted with the residual target probability p(x); on rejection p(x) is
zeroed and p renormalised; if no child is accepted the bonus is drawn from the residual), so every emitted token
follows the target's processed distribution exactly. Padding nodes are never children of anything here.
No host synchronisation: loops run over the static depth and width only, and draws are exponential races, not
torch.multinomial (both acceptors are core.verify's batched ones; this module adds SGLang's sampling parameters and
verify layout).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from jetflow_sglang.core.tree_batch import TreeBatch
from jetflow_sglang.core.verify import accept_noise, greedy_accept_batch, sample_accept_batch


def truncation(params, vocab: int) -> int:
    """How many of a node's most probable tokens the batch's sampled requests can keep, from their sampling params
    on the host (no device read; greedy requests, top_k 1, take their argmax path and are left out): 0 when none
    truncates (temperature alone: no sort at all); K < vocab when every one has top_k <= K (a top-K selection,
    within which top-p and min-p act as on the full sort); vocab otherwise (the full sort)."""
    sampled = [p for p in params if p.top_k != 1]
    if all(p.top_k >= vocab and p.top_p >= 1.0 and p.min_p <= 0 for p in sampled):
        return 0
    if all(p.top_k < vocab for p in sampled):
        return max(p.top_k for p in sampled)
    return vocab


def accept_batch(tree, logits, info, width: int, generator=None, keep: int | None = None, runner=None):
    """Acceptance for a batch that may mix greedy and sampled requests, on every tree size (one-node trees too).
    tree: a TreeBatch; logits [b*n, V] after penalties and grammar masks; info: SGLang's SamplingBatchInfo (its
    is_all_greedy, temperatures, top_ks, top_ps, min_ps); keep: `truncation` of the batch's requests (None: the full
    sort); runner: a core.graphs.GraphRunner that replays it from its capture per shape (its random draws are made
    first, from `generator`). -> (root-first path [b, depth + 1], -1 padded, bonus [b]).
    Every path holds at least the root, so every request emits at least one token per round."""
    bs, n = tree.tokens.shape
    depth = min(tree.depth_bound, n - 1)  # 0 on a one-node tree: the root alone, then the bonus token
    logits = logits.view(bs, n, -1)
    fields = (tree.tokens, tree.parents, tree.depths, tree.logps, tree.sizes, logits)
    if info.is_all_greedy:
        piece = lambda *f: _greedy(tree.max_depth, *f)  # noqa: E731
        return _run(runner, ("greedy", n, tree.max_depth, str(logits.dtype)), piece, *fields)
    min_p = bool(getattr(info, "need_min_p_sampling", False))
    params = [info.temperatures.view(bs, -1), info.top_ks.view(bs, -1).to(logits.device),
              info.top_ps.view(bs, -1).to(logits.device),
              (info.min_ps if min_p else info.top_ps).view(bs, -1).to(logits.device)]
    noise = accept_noise(bs, logits.shape[-1], depth, width, logits.device, generator)
    piece = lambda *f: _mixed(tree.max_depth, depth, width, keep, min_p, *f)  # noqa: E731
    return _run(runner, ("mixed", n, tree.max_depth, width, keep, min_p, str(logits.dtype)), piece, *fields, *params,
                *noise)


def _run(runner, key, piece, *inputs):
    return tuple(piece(*inputs)) if runner is None else runner.run("accept", key, piece, *inputs)


def _greedy(max_depth, tokens, parents, depths, logps, sizes, logits):
    tree = TreeBatch(tokens, parents, depths, logps, sizes, max_depth)
    path, _, bonus = greedy_accept_batch(tree, logits.argmax(-1))  # [b, depth + 1]: the engine's acceptor
    return path, bonus


def _mixed(max_depth, depth, width, keep, min_p, tokens, parents, depths, logps, sizes, logits, temps, top_ks, top_ps,
           min_ps, u, e):
    path, g_bonus = _greedy(max_depth, tokens, parents, depths, logps, sizes, logits)
    info = SimpleNamespace(temperatures=temps, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps, need_min_p_sampling=min_p)
    probs = processed_probs(logits, info, keep)
    chosen, s_bonus = sample_accept_batch(tokens, parents, sizes, probs, depth, width, noise=(u, e))
    s_path = torch.cat([chosen.new_zeros(chosen.shape[0], 1), chosen], 1)  # the root, then the accepted child per depth
    greedy = (top_ks.view(-1) == 1)  # SGLang turns temperature 0 into top_k = 1
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


def processed_probs(logits: torch.Tensor, info, keep: int | None = None) -> torch.Tensor:
    """[b, n, V] logits -> the probabilities SGLang's sampler draws from for each request (temperature, then top-k,
    top-p and min-p over the sorted distribution, as its torch sampler does), per node. keep (`truncation`): 0, the
    tempered softmax alone; K, the same truncation over each node's K most probable tokens (torch.topk instead of
    sorting the vocabulary); None or V, the full sort."""
    b, n, v = logits.shape
    temps = info.temperatures.view(b, 1, 1).float().clamp(min=1e-6)
    probs = (logits.float() / temps).softmax(-1)
    if keep == 0:
        return probs
    keep = v if keep is None else min(int(keep), v)
    if keep < v:
        sorted_p, idx = probs.topk(keep, -1)  # sorted, descending
    else:
        sorted_p, idx = probs.sort(-1, descending=True)
    ranks = torch.arange(keep, device=logits.device)[None, None]
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
