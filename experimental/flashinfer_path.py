"""FlashInfer verification paths (GPU only, optional: flashinfer is imported lazily, on first use).

1. Stock: `BatchPrefillWithPagedKVCacheWrapper.plan(..., custom_mask=bool)` exactly as SGLang's target-verify does it.
   The bool mask is [n_b, P_b + n_b] per request (flashinfer_custom_mask below), so its size grows with the
   prefix. Never use `packed_custom_mask` with batch > 1 in flashinfer 0.7.4 (its mask_indptr stays in bits, PR #2201).
2. Owned mask: a JIT attention variant (`variant_owns_mask=True`, fa2 kernels only) that reads the same packed int32
   words as the Triton kernel: O(N^2) bits per request whatever the prefix length.
Both need the tree's K/V already in the paged cache at positions P_b..P_b+n_b-1.
"""
from __future__ import annotations

import importlib
from typing import Sequence

import numpy as np
import torch

from jetflow_sglang.kernels.tree_mask import dense_allow, lens_from_indptr

# ---- FlashInfer's mask layouts and addressing, on the CPU ----------------------------------------------------------
def flashinfer_custom_mask(words: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """FlashInfer's bool `custom_mask` (flat): concat over b of row-major [n_b, kv_len_b], kv_len_b = P_b + n_b.

    This is what SGLang passes to `plan(custom_mask=...)` in target-verify mode; it costs n_b * (P_b + n_b) bits,
    growing with the prefix, which is why the packed layout exists.
    """
    lens = lens_from_indptr(qo_indptr)
    if len(prefix_lens) != len(lens):
        raise ValueError(f"{len(lens)} requests but {len(prefix_lens)} prefix lengths")
    starts = qo_indptr.tolist()
    parts = [dense_allow(words[s:s + n], n, int(p)).flatten() for s, n, p in zip(starts, lens, prefix_lens)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def flashinfer_mask_indptr(qo_indptr: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
    """Bit offsets of each request's segment, as FlashInfer's `_compute_page_mask_indptr` makes them."""
    sizes = [n * (int(p) + n) for n, p in zip(lens_from_indptr(qo_indptr), prefix_lens)]
    return torch.tensor([0] + np.cumsum(sizes).tolist(), dtype=torch.int64)


def packbits_little(custom_mask: torch.Tensor, mask_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU twin of `flashinfer.segment_packbits(mask, indptr, bitorder="little")` (which needs a GPU).

    Each segment is packed on its own and padded to whole bytes; returns (uint8 bytes, byte offsets).
    """
    flat = custom_mask.to(torch.bool).cpu().numpy()
    bounds = mask_indptr.tolist()
    chunks = [np.packbits(flat[a:b], bitorder="little") for a, b in zip(bounds, bounds[1:])]
    byte_indptr = [0] + np.cumsum([len(c) for c in chunks]).tolist()
    packed = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return torch.from_numpy(packed), torch.tensor(byte_indptr, dtype=torch.int64)


def flashinfer_mask_bit(packed: torch.Tensor, byte_indptr: torch.Tensor, b: int, qo_idx: int, kv_idx: int,
                        kv_len: int) -> bool:
    """Emulates `DefaultAttention::LogitsMask`: ptr = packed + indptr[b]; off = qo*kv_len + kv; ptr[off/8] >> off%8 & 1."""
    off = qo_idx * kv_len + kv_idx
    return bool((int(packed[int(byte_indptr[b]) + off // 8]) >> (off % 8)) & 1)


VARIANT_NAME = "JetFlowTreeMask"

# Each prefix column is visible; tree column j is visible iff bit j of the query row's packed word row is set.
# window_left = kv_len keeps FA2 from pruning KV tiles as if a sliding window applied: the mask decides everything.
TREE_VARIANT_DECL = r"""
struct JetFlowTreeMask : AttentionVariantBase {
  static constexpr bool use_softmax = true;

  uint32_t window_left, qo_len, kv_len, prefix_len, row0, words;
  float sm_scale_log2;

  template <typename Params>
  __device__ __host__ JetFlowTreeMask(const Params& params, uint32_t batch_idx, uint8_t* smem_ptr) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    prefix_len = kv_len - qo_len;  // the tree is the tail of the request's KV
    row0 = params.q_indptr[batch_idx];
    words = uint32_t(params.tree_words);
    window_left = kv_len;
    sm_scale_log2 = params.sm_scale * math::log2e;
  }

  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    if (kv_idx < prefix_len) return true;
    // Lanes past qo_len pad the last query tile; their results are dropped, only the address must stay valid.
    const uint32_t row = row0 + (qo_idx < qo_len ? qo_idx : qo_len - 1);
    const uint32_t j = kv_idx - prefix_len;
    const uint32_t word = uint32_t(params.tree_mask[row * words + (j >> 5)]);
    return ((word >> (j & 31u)) & 1u) != 0u;
  })
};
"""
VARIANT_TENSORS = (["tree_mask"], ["int32_t"])
VARIANT_SCALARS = (["tree_words", "sm_scale"], ["int64_t", "double"])


def flashinfer():
    """The flashinfer module; raises ImportError with an install hint when it is absent."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise ImportError("the FlashInfer path needs `pip install flashinfer-python` (GPU machines only)") from e


def available() -> bool:
    try:
        flashinfer()
        return True
    except Exception:
        return False


def paged_kv_args(block_table: torch.Tensor, kv_lens: Sequence[int], page_size: int) -> dict:
    """A block table -> FlashInfer's paged_kv_indptr / indices / last_page_len (int32, on block_table's device)."""
    counts = [-(-int(n) // page_size) for n in kv_lens]
    if any(c > block_table.shape[1] for c in counts):
        raise ValueError(f"block table has {block_table.shape[1]} pages per request, need {max(counts)}")
    indices = torch.cat([block_table[b, :c] for b, c in enumerate(counts)]) if counts else block_table.new_zeros(0)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([int(n) - (c - 1) * page_size if c else 0 for n, c in zip(kv_lens, counts)], dtype=torch.int32)
    dev = block_table.device
    return dict(paged_kv_indptr=indptr.to(dev), paged_kv_indices=indices.to(torch.int32),
                paged_kv_last_page_len=last.to(dev))


def stock_plan_args(block_table, prefix_lens, qo_indptr, mask_words, page_size: int) -> dict:
    """Positional/keyword arguments for `wrapper.plan` with the bool custom mask, as SGLang target-verify builds them."""
    ps = [int(p) for p in prefix_lens.tolist()]
    kv_lens = [p + n for p, n in zip(ps, lens_from_indptr(qo_indptr))]
    args = dict(qo_indptr=qo_indptr.to(torch.int32), **paged_kv_args(block_table, kv_lens, page_size))
    args["custom_mask"] = flashinfer_custom_mask(mask_words.cpu(), qo_indptr.cpu(), ps).to(block_table.device)
    return args


def plan_stock(wrapper, block_table, prefix_lens, qo_indptr, mask_words, num_qo_heads, num_kv_heads, head_dim,
               page_size, dtype, sm_scale=None):
    a = stock_plan_args(block_table, prefix_lens, qo_indptr, mask_words, page_size)
    wrapper.plan(a["qo_indptr"], a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"],
                 num_qo_heads, num_kv_heads, head_dim, page_size, custom_mask=a["custom_mask"], causal=False,
                 sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype)


def tree_variant_jit_args(dtype: torch.dtype, head_dim: int, uri: str | None = None) -> list:
    """`jit_args` for BatchPrefillWithPagedKVCacheWrapper(..., backend="fa2", variant_owns_mask=True)."""
    uri = uri or f"jetflow_tree_mask_{str(dtype).split('.')[-1]}_d{head_dim}"
    return [uri, dtype, dtype, dtype, torch.int32, head_dim, head_dim, *VARIANT_TENSORS, *VARIANT_SCALARS,
            VARIANT_NAME, TREE_VARIANT_DECL]


def make_tree_wrapper(workspace: torch.Tensor, dtype: torch.dtype, head_dim: int, kv_layout: str = "NHD"):
    fi = flashinfer()
    return fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend="fa2",
                                                   jit_args=tree_variant_jit_args(dtype, head_dim),
                                                   variant_owns_mask=True)


def run_tree_variant(wrapper, q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, mask_words, sm_scale=None):
    """Plan (no mask tensor: the variant owns it) and run; k/v_cache [pages, page_size, Hkv, D] (NHD)."""
    page_size, hkv, d = k_cache.shape[1:]
    ps = [int(p) for p in prefix_lens.tolist()]
    kv = paged_kv_args(block_table, [p + n for p, n in zip(ps, lens_from_indptr(qo_indptr))], page_size)
    wrapper.plan(qo_indptr.to(torch.int32), kv["paged_kv_indptr"], kv["paged_kv_indices"],
                 kv["paged_kv_last_page_len"], q.shape[1], hkv, d, page_size, causal=False, q_data_type=q.dtype,
                 kv_data_type=k_cache.dtype)
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    return wrapper.run(q, (k_cache, v_cache), mask_words.contiguous(), int(mask_words.shape[1]), float(sm_scale))


def emulate_variant_mask(mask_words: torch.Tensor, qo_indptr: torch.Tensor, b: int, qo_idx: int, kv_idx: int,
                         kv_len: int) -> bool:
    """Python twin of TREE_VARIANT_DECL's LogitsMask (same arithmetic on the same flat int32 buffer)."""
    qo_len = int(qo_indptr[b + 1] - qo_indptr[b])
    prefix_len = kv_len - qo_len
    if kv_idx < prefix_len:
        return True
    row = int(qo_indptr[b]) + (qo_idx if qo_idx < qo_len else qo_len - 1)
    j = kv_idx - prefix_len
    word = int(mask_words.flatten()[row * mask_words.shape[1] + (j >> 5)]) & 0xFFFFFFFF
    return bool((word >> (j & 31)) & 1)
