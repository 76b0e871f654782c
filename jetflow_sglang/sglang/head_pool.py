"""The draft head's context K/V, paged like the target's KV cache.

One row per target KV slot: the head's keys/values for the token whose target K/V lives in slot s are at row s of
every head layer's buffer. Rows are found through SGLang's `req_to_token` exactly like the target's, so
- a radix-cache prefix hit reuses the head's rows too (the slots are the cached ones),
- retraction, chunked prefill, filter/merge of batches and request ends need no bookkeeping here,
- nothing grows per request: the pool is sized once, to the target's pool (`size` slots + SGLang's padding slot 0).
Rows are written from the target's tap hidden states when the target writes its own K/V for committed tokens:
at prefill (every chunk) and for the accepted nodes of each verify (at the slots they are moved to).
"""
from __future__ import annotations

import torch


class HeadKVPool:
    def __init__(self, head, size: int, device, dtype=None):
        cfg = head.config
        self.head = head
        self.size = int(size)
        self.layers = cfg.num_layers
        dtype = dtype or head.fc.weight.dtype
        shape = (self.size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @torch.no_grad()
    def write(self, loc: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Head K/V of committed rows: loc [N] slots, taps [N, n_taps * hidden], positions [N] (token positions)."""
        if loc.numel() == 0:
            return
        kv = self.head.context_kv(taps[None], positions[None].to(taps.device))
        loc = loc.long()
        for layer, (k, v) in enumerate(kv):
            self.k[layer][loc] = k[0].transpose(0, 1).to(self.k[layer].dtype)
            self.v[layer][loc] = v[0].transpose(0, 1).to(self.v[layer].dtype)

    def gather(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, ctx_lens: torch.Tensor,
               max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded context K/V of a batch: per head layer (k, v) [b, Hkv, max_len, D]. Row t of request i is valid
        iff t < ctx_lens[i]; the rest reads whatever slot req_to_token holds there (callers mask it)."""
        cols = torch.arange(max_len, device=req_to_token.device)
        slots = req_to_token[req_pool_indices.long()][:, :max_len].long()
        slots = torch.where(cols[None] < ctx_lens[:, None].to(slots.device), slots, torch.zeros_like(slots))
        return [(k[slots].transpose(1, 2), v[slots].transpose(1, 2)) for k, v in zip(self.k, self.v)]
