"""Paged tree attention in Triton: N tree nodes per request attend to the request's committed prefix and to their own
ancestors + themselves, the tree mask read from packed int32 words (see jetflow_sglang/kernels/tree_mask.py).

Layouts (FlashInfer/SGLang NHD paged style):
  q            [total_q, Hq, D]            rows of request b at qo_indptr[b]:qo_indptr[b+1] (n_b tree nodes)
  k/v_cache    [num_pages, page_size, Hkv, D]  request b's token at position t lives at page block_table[b, t // page_size],
                                           slot t % page_size; the prefix is t < P_b, tree node j sits at t = P_b + j
  block_table  int32 [B, max_pages];  prefix_lens int32 [B];  qo_indptr int32 [B+1]
  mask_words   int32 [total_q, W] (W * 32 >= max n_b), little-endian bits: bit j of row i = node j visible to node i
Output: [total_q, Hq, D] in q's dtype. Online softmax in fp32 (exp2 form); q/k/v stay in their dtype for tl.dot.

Import this module only where Triton runs: with TRITON_INTERPRET=1 set *before* import on CPU, or on a CUDA machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TREE_TILE = 32  # tree columns per step: exactly one mask word per row


@triton.jit
def _attend(q, k, v, allow, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: a GPU would otherwise use TF32 (~1e-3 error)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(allow, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 there so no -inf - -inf (NaN) appears.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_kv(K, V, bt, pos, ok, offs_d, d_ok, kvh, page_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
             stride_vh):
    page = tl.load(bt + pos // page_size, mask=ok, other=0).to(tl.int64)
    slot = pos % page_size
    kp = K + page * stride_kp + slot * stride_ks + kvh * stride_kh
    vp = V + page * stride_vp + slot * stride_vs + kvh * stride_vh
    kd_ok = ok[:, None] & d_ok[None, :]
    k = tl.load(kp[:, None] + offs_d[None, :], mask=kd_ok, other=0.0)
    v = tl.load(vp[:, None] + offs_d[None, :], mask=kd_ok, other=0.0)
    return k, v


@triton.jit
def _tree_attn_fwd(Q, K, V, O, Part, ML, BlockTable, PrefixLens, QoIndptr, MaskWords, qk_scale,
                   stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   stride_ot, stride_oh, stride_bt, stride_mw, page_size, total_q,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # Split-KV (flash-decoding) when NUM_SPLITS > 1: program (m block, split) reads the split-th chunk of the prefix
    # (the last split also the tree) and writes its unnormalised partial result to Part / ML for _combine.
    pid_m = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP
    q0 = tl.load(QoIndptr + b)
    n = tl.load(QoIndptr + b + 1) - q0
    m_start = pid_m * BLOCK_M
    if m_start >= n:  # the grid is sized for the longest tree of the batch
        return
    P = tl.load(PrefixLens + b)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n
    d_ok = offs_d < HEAD_DIM
    rows = (q0 + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt = BlockTable + b.to(tl.int64) * stride_bt

    # Phase 1: the committed prefix (this split's chunk of it), visible to every node; bounds are the only mask.
    chunk = tl.cdiv(tl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    for s in range(lo, tl.minimum(P, lo + chunk), BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        ok = pos < P
        k, v = _load_kv(K, V, bt, pos, ok, offs_d, d_ok, kvh, page_size, stride_kp, stride_ks, stride_kh,
                        stride_vp, stride_vs, stride_vh)
        m_i, l_i, acc = _attend(q, k, v, ok[None, :], m_i, l_i, acc, qk_scale, IEEE)

    # Phase 2: the tree's own K/V at positions P..P+n-1, 32 columns per step so each row needs one mask word.
    cols = tl.arange(0, 32)
    if CAUSAL:  # the plain-causal baseline (same kernel, no mask loads): node i sees nodes 0..i
        hi = tl.minimum(n, m_start + BLOCK_M)
    else:
        hi = n
    hi = tl.where(split == NUM_SPLITS - 1, hi, 0)  # the tree goes to the last split
    for t in range(0, hi, 32):
        j = t + cols
        ok = j < n
        if CAUSAL:
            allow = (j[None, :] <= offs_m[:, None]) & ok[None, :]
            live = 1
        else:
            w = tl.load(MaskWords + rows * stride_mw + t // 32, mask=row_ok, other=0)
            allow = (((w[:, None] >> cols[None, :]) & 1) != 0) & ok[None, :]
            live = tl.max(w != 0, 0)  # skip tiles no row of this block can see (the upper triangle, typically)
        if live:
            k, v = _load_kv(K, V, bt, P + j, ok, offs_d, d_ok, kvh, page_size, stride_kp, stride_ks, stride_kh,
                            stride_vp, stride_vs, stride_vh)
            m_i, l_i, acc = _attend(q, k, v, allow, m_i, l_i, acc, qk_scale, IEEE)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:  # Part [S, T, Hq, BLOCK_D] and ML [S, T, Hq, 2] (fp32, contiguous)
        idx = (split * total_q + rows) * tl.num_programs(1) + h
        tl.store(Part + idx[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ML + idx * 2, m_i, mask=row_ok)
        tl.store(ML + idx * 2 + 1, l_i, mask=row_ok)


def _combine(part: torch.Tensor, ml: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Merge the splits' partial softmax results: [S, T, Hq, BLOCK_D] + [S, T, Hq, 2] -> [T, Hq, d]."""
    m, l = ml[..., 0], ml[..., 1]
    top = m.max(0).values
    w = torch.exp2(m - torch.where(torch.isinf(top), torch.zeros_like(top), top))  # a split that saw nothing: 0
    total = (w * l).sum(0)
    out = (w[..., None] * part).sum(0) / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return out[..., :d].to(dtype)


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def pick_config(head_dim: int, dtype: torch.dtype) -> Config:
    """The shipped configs (checked by the sm_90 AOT test for 0 spills): one per head-dim class and dtype width."""
    if dtype == torch.float32:  # exact (ieee) fp32 runs on FMA, not tensor cores; small tiles keep it spill-free
        return Config(16, 32, 8, 1)
    return Config(64, 64, 8 if head_dim > 64 else 4, 2)


SHIPPED = [(d, dt) for d in (64, 128) for dt in (torch.bfloat16, torch.float16, torch.float32)]


def _check(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"want q [T,Hq,D], k/v_cache [pages,page_size,Hkv,D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"head dims differ or Hq={hq} is not a multiple of Hkv={hkv}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q/k/v must share one of fp16/bf16/fp32, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("block_table", block_table), ("prefix_lens", prefix_lens), ("qo_indptr", qo_indptr),
                    ("mask_words", mask_words)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    b = prefix_lens.shape[0]
    if qo_indptr.shape != (b + 1,) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"batch mismatch: prefix_lens {tuple(prefix_lens.shape)}, qo_indptr {tuple(qo_indptr.shape)}, "
                         f"block_table {tuple(block_table.shape)}")
    if mask_words.dim() != 2 or mask_words.shape[0] != q.shape[0]:
        raise ValueError(f"mask_words must be [total_q={q.shape[0]}, W], got {tuple(mask_words.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or mask_words.stride(1) != 1:
        raise ValueError("the head dim of q/k/v and the word dim of mask_words must be contiguous")


def pick_splits(max_prefix: int, max_q: int, hq: int, batch: int, head_dim: int, dtype: torch.dtype,
                sm_count: int) -> int:
    """Prefix chunks per (m block, head, request) so that a long prefix keeps every SM busy: about two programs
    per SM, chunks of at least 512 prefix tokens, at most 16 splits. 1 (no split) for short prefixes, and for
    float32: the exact (ieee) fp32 kernel is the lossless-check path, and its split variant spills registers."""
    if dtype == torch.float32:
        return 1
    programs = triton.cdiv(max(1, max_q), pick_config(head_dim, dtype).block_m) * hq * batch
    return max(1, min(16, max_prefix // 512, triton.cdiv(2 * sm_count, programs)))


def _launch(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale, max_q, causal, out=None,
            config: Config | None = None, num_splits: int = 1):
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    cfg = config or pick_config(d, q.dtype)
    if t == 0 or max_q == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    if num_splits > 1:
        part = torch.empty(num_splits, t, hq, block_d, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_splits, t, hq, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # not read
    grid = (triton.cdiv(max_q, cfg.block_m) * num_splits, hq, prefix_lens.shape[0])
    _tree_attn_fwd[grid](
        q, k_cache, v_cache, out, part, ml, block_table, prefix_lens, qo_indptr, mask_words,
        sm_scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), mask_words.stride(0), k_cache.shape[1], t,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, CAUSAL=causal, IEEE=q.dtype == torch.float32, NUM_SPLITS=num_splits,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        out.copy_(_combine(part, ml, d, q.dtype))
    return out


@torch.library.custom_op("jetflow::tree_attn", mutates_args=())
def tree_attn_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 prefix_lens: torch.Tensor, qo_indptr: torch.Tensor, mask_words: torch.Tensor, sm_scale: float,
                 max_q: int, causal: bool = False, num_splits: int = 1) -> torch.Tensor:
    return _launch(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale, max_q, causal,
                   num_splits=num_splits)


@tree_attn_op.register_fake
def _(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale, max_q, causal=False,
      num_splits=1):
    return torch.empty_like(q)


def tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale=None, max_q=None,
                   causal=False, num_splits: int = 1):
    """Checked entry point. Pass max_q (the largest n_b, static per graph bucket) to avoid a device sync.
    num_splits > 1 splits the prefix across programs (flash-decoding) and merges them; `pick_splits` chooses it."""
    _check(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words)
    if max_q is None:
        max_q = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if prefix_lens.numel() else 0
    if not causal and mask_words.shape[1] * 32 < max_q:
        raise ValueError(f"{mask_words.shape[1]} mask words per row cover {mask_words.shape[1] * 32} nodes < {max_q}")
    if not 1 <= int(num_splits) <= 64:
        raise ValueError(f"num_splits must be in [1, 64], got {num_splits}")
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return torch.ops.jetflow.tree_attn(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words,
                                       sm_scale, int(max_q), bool(causal), int(num_splits))
