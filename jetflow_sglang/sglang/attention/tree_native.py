"""`jetflow_tree_native`: SGLang's torch_native SDPA backend plus tree verification, for CPU.

Stock torch_native ignores `spec_info.custom_mask` and, in TARGET_VERIFY, reads extend_* fields the batch
does not carry. Here each request's n verify rows attend to its committed prefix (all of it) and, inside the
window, to the columns its tree mask allows (ancestors + self). Both mask layouts SGLang uses are accepted:
QLEN_ONLY (n*n per request, what JETFLOW and NGRAM build on CPU) and FULL (n*(L+n) per request).
"""
from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from jetflow_sglang.sglang.attention.guard import TREE_NATIVE

NAME = TREE_NATIVE  # the name SGLang knows it by (attention/guard.py names both of ours)


def host_max_len(forward_batch) -> int:
    """A host bound on the batch's committed lengths without reading the device: the worker's
    `max_seq_len_host` (from the requests' KV bookkeeping), else SGLang's host mirror, else (a blocking read)
    the device lengths."""
    bound = getattr(forward_batch, "max_seq_len_host", None)
    if bound is not None:
        return int(bound)
    if forward_batch.seq_lens_cpu is not None:
        return int(forward_batch.seq_lens_cpu.max())
    return int(forward_batch.seq_lens.max())


def tree_rows_mask(custom_mask: torch.Tensor, seq_lens: list[int], n: int) -> list[torch.Tensor]:
    """Per request, the [n, n] in-window mask, whatever layout `custom_mask` uses."""
    bs = len(seq_lens)
    if custom_mask.numel() == bs * n * n:  # QLEN_ONLY
        return list(custom_mask.view(bs, n, n).bool())
    out, off = [], 0  # FULL: request i is an [n, L_i + n] block
    for L in seq_lens:
        block = custom_mask[off: off + n * (L + n)].view(n, L + n)
        out.append(block[:, L:].bool())
        off += n * (L + n)
    return out


def window_mask(custom_mask: torch.Tensor, seq_lens: torch.Tensor, n: int, max_len: int) -> torch.Tensor:
    """[b, n, max_len + n] attention mask over the request's rows req_to_token[:, :max_len + n]: the committed prefix
    (columns < L) and, in the window L..L+n, the tree mask; padding columns are False."""
    b = seq_lens.shape[0]
    dev = seq_lens.device
    if custom_mask is None:
        tree = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n)
    else:
        tree = torch.stack([t.to(dev) for t in tree_rows_mask(custom_mask, seq_lens.tolist(), n)]) \
            if custom_mask.numel() != b * n * n else custom_mask.view(b, n, n).bool().to(dev)
    width = max_len + n
    cols = torch.arange(width, device=dev)[None, None]
    L = seq_lens.long()[:, None, None]
    in_tree = (cols >= L) & (cols < L + n)
    return (cols < L) | (in_tree & tree.gather(2, (cols - L).clamp(0, n - 1).expand(b, n, width)))


class TreeTorchNativeAttnBackend(TorchNativeAttnBackend):
    # verify rounds size their window from host_max_len, so SGLang's overlap scheduler need not copy seq_lens to the
    # host every round (its FutureMap reads this flag)
    needs_cpu_seq_lens = False

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        spec = forward_batch.spec_info
        n = spec.draft_token_num
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        seq_lens = forward_batch.seq_lens  # committed lengths; the n draft rows follow them
        b = seq_lens.shape[0]
        max_len = host_max_len(forward_batch)
        cache = getattr(forward_batch, "_jetflow_window", None)
        if cache is None or cache[0] != max_len:  # one mask and one slot gather per forward, shared by all layers
            rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), : max_len + n].long()
            cache = (max_len, rows, window_mask(spec.custom_mask, seq_lens, n, max_len))
            forward_batch._jetflow_window = cache
        _, rows, mask = cache
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        qq = q.reshape(b, n, hq, d).transpose(1, 2)  # [b, Hq, n, d]
        flat = rows.view(-1)  # index_select: about 4x faster on CPU than indexing with the 2-D rows
        kk = k_buf.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2).to(qq.dtype)  # [b, Hkv, max_len + n, d]
        vv = v_buf.index_select(0, flat).view(b, -1, hkv, v_buf.shape[-1]).transpose(1, 2).to(qq.dtype)
        out = sdpa(qq, kk, vv, attn_mask=mask[:, None], scale=layer.scaling, enable_gqa=hq != hkv)
        return out.transpose(1, 2).reshape(b * n, hq * layer.v_head_dim)
