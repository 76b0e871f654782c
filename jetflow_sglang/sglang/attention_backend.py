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

NAME = "jetflow_tree_native"


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


class TreeTorchNativeAttnBackend(TorchNativeAttnBackend):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        spec = forward_batch.spec_info
        n = spec.draft_token_num
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q = q.reshape(-1, hq, d)
        o = q.new_empty(q.shape[0], hq, layer.v_head_dim)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        seq_lens = forward_batch.seq_lens.tolist()  # committed lengths; the n draft rows follow them
        masks = tree_rows_mask(spec.custom_mask, seq_lens, n) if spec.custom_mask is not None else None
        r2t = self.req_to_token_pool.req_to_token
        for i, (rpi, L) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens)):
            rows = r2t[rpi, : L + n]
            kk, vv = k_buf[rows].movedim(0, 1), v_buf[rows].movedim(0, 1)  # [Hkv, L+n, d]
            tree = masks[i] if masks is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            mask = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), tree.to(q.device)], 1)
            qi = q[i * n: (i + 1) * n].movedim(0, 1)  # [Hq, n, d]
            out = sdpa(qi.unsqueeze(0), kk.unsqueeze(0).to(qi.dtype), vv.unsqueeze(0).to(qi.dtype), attn_mask=mask,
                       scale=layer.scaling, enable_gqa=hq != hkv)
            o[i * n: (i + 1) * n] = out.squeeze(0).movedim(0, 1)
        return o.view(-1, hq * layer.v_head_dim)
