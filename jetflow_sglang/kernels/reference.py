"""Reference and CPU paths for paged tree attention (the arguments of triton_tree_attn.tree_attention).

`tree_attn_reference` is the float64 oracle (dense mask, explicit GQA repeat). `tree_attn_sdpa` is the CPU execution
path: SDPA with a bool mask [n, P+n] and enable_gqa, the fastest correct CPU option measured (notes/kernels.md §3).
"""
from __future__ import annotations

import math

import torch

from jetflow_sglang.kernels.tree_mask import dense_allow, lens_from_indptr


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Request b's first `length` positions of a paged cache [pages, page_size, H, D] -> contiguous [length, H, D]."""
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    pages = block_table[b].to(cache.device).long()[pos // page_size]
    return cache[pages, pos % page_size]


def _requests(q, block_table, prefix_lens, qo_indptr):
    starts = qo_indptr.tolist()
    for b, (n, p) in enumerate(zip(lens_from_indptr(qo_indptr), prefix_lens.tolist())):
        yield b, starts[b], n, int(p)


def tree_attn_reference(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale=None,
                        causal=False) -> torch.Tensor:
    """float64 [total_q, Hq, D]. causal=True gives plain causal attention over the tail instead of the tree mask."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, s, n, p in _requests(q, block_table, prefix_lens, qo_indptr):
        if n == 0:
            continue
        k = gather_kv(k_cache, block_table, b, p + n).double().repeat_interleave(group, 1)
        v = gather_kv(v_cache, block_table, b, p + n).double().repeat_interleave(group, 1)
        if causal:
            allow = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
            allow[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            allow = dense_allow(mask_words[s:s + n], n, p).to(q.device)
        scores = torch.einsum("qhd,khd->hqk", q[s:s + n].double(), k) * sm_scale
        scores = scores.masked_fill(~allow, float("-inf"))
        out[s:s + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def tree_attn_sdpa(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale=None) -> torch.Tensor:
    """CPU path: per request, SDPA with the bool tree mask; output in q's dtype."""
    out = torch.empty_like(q)
    for b, s, n, p in _requests(q, block_table, prefix_lens, qo_indptr):
        if n == 0:
            continue
        k = gather_kv(k_cache, block_table, b, p + n).transpose(0, 1)
        v = gather_kv(v_cache, block_table, b, p + n).transpose(0, 1)
        allow = dense_allow(mask_words[s:s + n], n, p).to(q.device)
        o = torch.nn.functional.scaled_dot_product_attention(q[s:s + n].transpose(0, 1), k, v, attn_mask=allow,
                                                             scale=sm_scale, enable_gqa=True)
        out[s:s + n] = o.transpose(0, 1)
    return out
