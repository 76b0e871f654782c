"""`jetflow_tree_triton`: tree verification with the project's Triton kernel (kernels/triton_tree_attn.py), in place
over SGLang's paged KV pool.

TARGET_VERIFY: each request's n tree rows attend to its committed prefix and to their own ancestors:
  - the pool's k/v buffers are viewed as pages of `--page-size` tokens: [pages, page_size, Hkv, D], no copy;
  - the block table is req_to_token read at the first slot of every page (slot // page_size), up to the longest
    request's prefix + n;
  - prefix lengths are seq_lens, the rows of request b are b*n .. b*n + n - 1 (JETFLOW's fixed n per request);
  - the tree mask is bit-packed on the device (n*n bits per request, never the prefix) from the verify input's
    QLEN_ONLY rows, once per forward and shared by every layer. No dense mask, no host sync.
EXTEND and DECODE go to SGLang's triton backend on CUDA and to jetflow_tree_native elsewhere.

On a CPU, Triton kernels run only under its interpreter: start the server with TRITON_INTERPRET=1 (the backend guard
refuses the backend without it, in one line). That is how CI runs this path; it is a correctness path, not a fast one.
"""
from __future__ import annotations

import logging

import torch

from jetflow_sglang.core.tree import pack_bits
from jetflow_sglang.sglang.attention.tree_native import TreeTorchNativeAttnBackend, host_max_len, tree_rows_mask
from jetflow_sglang.sglang.attention.guard import TREE_TRITON

NAME = TREE_TRITON  # the name SGLang knows it by
logger = logging.getLogger(__name__)


def pack_tree_rows(rows: torch.Tensor) -> torch.Tensor:
    """[b, n, n] bool ancestor-or-self rows -> int32 words [b*n, W] (bit j%32 of word j//32 = node j visible),
    on the rows' device (core.tree.pack_bits, the one packing)."""
    b, n, _ = rows.shape
    return pack_bits(rows.reshape(b * n, n))


def block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, width: int, page_size: int):
    """int32 [b, pages]: the page of each request's tokens 0, page_size, 2*page_size, ... < width."""
    return (req_to_token[req_pool_indices.long(), 0:width:page_size] // page_size).to(torch.int32)


def paged(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool buffer [slots, H, D] as [pages, page_size, H, D] (a view; SGLang sizes pools in whole pages)."""
    if buf.shape[0] % page_size:
        raise ValueError(f"{NAME}: a KV pool of {buf.shape[0]} slots is not a whole number of {page_size}-token pages")
    return buf.view(buf.shape[0] // page_size, page_size, *buf.shape[1:])


class TreeTritonVerify:
    """TARGET_VERIFY through the Triton tree kernel; everything else through the class it is mixed into."""

    def _tree_inputs(self, forward_batch, n: int):
        """(block table, prefix lens, qo_indptr, mask words, longest prefix), built once per forward and shared by
        all layers."""
        cached = getattr(forward_batch, "_jetflow_triton", None)
        if cached is not None:
            return cached
        seq_lens = forward_batch.seq_lens
        b = seq_lens.shape[0]
        max_len = host_max_len(forward_batch)
        page = self._page_size()
        bt = block_table(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, max_len + n, page)
        mask = forward_batch.spec_info.custom_mask
        if mask is None:  # a chain (no tree): ancestors = the earlier rows
            rows = torch.ones(n, n, dtype=torch.bool, device=seq_lens.device).tril().expand(b, n, n)
        elif mask.numel() == b * n * n:  # QLEN_ONLY: what JETFLOW builds for this backend
            rows = mask.view(b, n, n).bool()
        else:  # FULL (NGRAM's layout elsewhere): the in-window blocks
            rows = torch.stack(tree_rows_mask(mask, forward_batch.seq_lens_cpu.tolist(), n)).to(seq_lens.device)
        qo_indptr = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=seq_lens.device)
        cached = (bt, seq_lens.to(torch.int32), qo_indptr, pack_tree_rows(rows), max_len)
        forward_batch._jetflow_triton = cached
        return cached

    def _splits(self, q, max_len: int, n: int, batch: int) -> int:
        """Split-KV chunks for long prefixes on a GPU (kernels.triton_tree_attn.pick_splits); 1 elsewhere."""
        if not q.is_cuda:
            return 1
        from jetflow_sglang.kernels.triton_tree_attn import pick_splits

        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        return pick_splits(max_len, n, q.shape[1], batch, q.shape[2], q.dtype, sms)

    def _page_size(self) -> int:
        return int(getattr(self, "page_size", None) or getattr(self.token_to_kv_pool, "page_size", 1) or 1)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kw)
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        from jetflow_sglang.kernels.triton_tree_attn import tree_attention

        if getattr(layer, "logit_cap", 0) or getattr(layer, "sliding_window_size", -1) not in (-1, None):
            raise NotImplementedError(f"{NAME}: logit capping and sliding-window layers are not supported")
        n = forward_batch.spec_info.draft_token_num
        if save_kv_cache and k is not None:  # as jetflow_tree_native writes them (the tree rows' own slots)
            loc = KVWriteLoc(forward_batch.out_cache_loc, getattr(self, "swa_out_cache_loc", None))
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        bt, prefix, qo_indptr, words, max_len = self._tree_inputs(forward_batch, n)
        if not getattr(self, "_announced", False):
            self._announced = True
            where = "CUDA" if q.is_cuda else "interpreter"
            logger.info(f"{NAME}: TARGET_VERIFY through the Triton tree kernel ({where})")
        page = self._page_size()
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        k_cache = paged(self.token_to_kv_pool.get_key_buffer(layer.layer_id), page)
        v_cache = paged(self.token_to_kv_pool.get_value_buffer(layer.layer_id), page)
        qq = q.reshape(-1, hq, d)
        if k_cache.dtype != qq.dtype:  # e.g. an fp8 pool: the kernel reads q, k and v in one dtype
            raise NotImplementedError(f"{NAME}: a {k_cache.dtype} KV cache with {qq.dtype} queries is not supported; "
                                      f"use --kv-cache-dtype auto")
        out = tree_attention(qq.contiguous(), k_cache, v_cache, bt, prefix, qo_indptr, words,
                             sm_scale=layer.scaling, max_q=n,
                             num_splits=self._splits(qq, max_len, n, prefix.shape[0]))
        return out.reshape(-1, hq * layer.v_head_dim)


class TreeTritonCPUBackend(TreeTritonVerify, TreeTorchNativeAttnBackend):
    """CPU (Triton interpreter): EXTEND and DECODE through jetflow_tree_native."""


def create(runner):
    """The backend for this runner's device (the factory the plugin registers under NAME)."""
    if str(runner.device).startswith("cuda"):
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        class TreeTritonCUDABackend(TreeTritonVerify, TritonAttnBackend):
            """CUDA: EXTEND and DECODE through SGLang's triton backend (not yet run on a GPU: see docs/SERVING.md)."""

        return TreeTritonCUDABackend(runner)
    return TreeTritonCPUBackend(runner)
