"""The draft head's context K/V, paged like the target's KV cache.

One row per target KV slot: the head's keys/values for the token whose target K/V lives in slot s are at row s of
every head layer's buffer. Rows are found through SGLang's `req_to_token` exactly like the target's, so
- a radix-cache prefix hit reuses the head's rows too (the slots are the cached ones),
- retraction, chunked prefill, filter/merge of batches and request ends need no bookkeeping here,
- nothing grows per request: the pool is sized once, to the target's pool (`size` slots + SGLang's padding slot 0).
Rows are written from the target's tap hidden states when the target writes its own K/V for committed tokens:
at prefill (every chunk) and for the accepted nodes of each verify (at the slots they are moved to). Each row also
keeps its token id, so a request's committed tokens are read through `req_to_token` on the device as well (the
prompt-lookup tries of JETFLOW_LOOKUP, lookup_batch.py), radix-cache hits included.
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
        self.tokens = torch.zeros(self.size, dtype=torch.int32, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + [self.tokens])

    @torch.no_grad()
    def write(self, loc: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Committed rows: loc [N] slots, taps [N, n_taps * hidden], positions [N] (token positions), tokens [N]."""
        if loc.numel() == 0:
            return
        self.tokens[loc.long()] = tokens.to(self.tokens.dtype)
        kv = self.head.context_kv(taps[None], positions[None].to(taps.device))
        loc = loc.long()
        for layer, (k, v) in enumerate(kv):
            self.k[layer][loc] = k[0].transpose(0, 1).to(self.k[layer].dtype)
            self.v[layer][loc] = v[0].transpose(0, 1).to(self.v[layer].dtype)

    @staticmethod
    def slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, ctx_lens: torch.Tensor,
              max_len: int) -> torch.Tensor:
        """Long [b, max_len]: the slots of every request's first max_len tokens (padding slot 0 past ctx_lens[i])."""
        cols = torch.arange(max_len, device=req_to_token.device)
        slots = req_to_token[req_pool_indices.long()][:, :max_len].long()
        return torch.where(cols[None] < ctx_lens[:, None].to(slots.device), slots, torch.zeros_like(slots))

    def gather(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded context K/V of a batch (slots [b, L] from `slots`): per head layer (k, v) [b, Hkv, L, D]."""
        return [(k[slots].transpose(1, 2), v[slots].transpose(1, 2)) for k, v in zip(self.k, self.v)]

    def history(self, slots: torch.Tensor) -> torch.Tensor:
        """Long [b, L]: the token ids at those slots."""
        return self.tokens[slots].long()
