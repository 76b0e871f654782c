"""Per-KV-slot state of the drafter, paged like the target's KV cache: the head's context K/V and the token ids.

One row per target KV slot: row s belongs to the token whose target K/V lives in slot s. Rows are found through
SGLang's `req_to_token` exactly like the target's, so
- a radix-cache prefix hit reuses them too (the slots are the cached ones),
- retraction, chunked prefill, filter/merge of batches and request ends need no bookkeeping here,
- nothing grows per request: the pools are sized once, to the target's pool (`size` slots + SGLang's padding slot 0).
Rows are written when the target writes its own K/V for committed tokens: at prefill (every chunk) and for the
accepted nodes of each verify (at the slots they are moved to).
- HeadKVPool: the head's keys/values, from the target's tap hidden states (every head layer's buffer, row s).
- SlotTokens: the token ids, so a request's committed tokens are read on the device too (the prompt-lookup tries of
  lookup_batch.py: JETFLOW_LOOKUP, and the head-less ngram drafter).
"""
from __future__ import annotations

import torch


def slots_of(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, ctx_lens: torch.Tensor,
             max_len: int) -> torch.Tensor:
    """Long [b, max_len]: the slots of every request's first max_len tokens (padding slot 0 past ctx_lens[i])."""
    cols = torch.arange(max_len, device=req_to_token.device)
    slots = req_to_token[req_pool_indices.long()][:, :max_len].long()
    return torch.where(cols[None] < ctx_lens[:, None].to(slots.device), slots, torch.zeros_like(slots))


class SlotTokens:
    def __init__(self, size: int, device):
        self.size = int(size)
        self.ids = torch.zeros(self.size, dtype=torch.int32, device=device)

    @property
    def bytes(self) -> int:
        return self.ids.numel() * self.ids.element_size()

    def write(self, loc: torch.Tensor, tokens: torch.Tensor) -> None:
        self.ids[loc.long()] = tokens.to(self.ids.dtype)

    def history(self, slots: torch.Tensor) -> torch.Tensor:
        """Long [b, L]: the token ids at those slots (slots_of)."""
        return self.ids[slots].long()


class HeadKVPool:
    def __init__(self, head, size: int, device, dtype=None):
        cfg = head.config
        self.head = head
        self.kv_weight = head.fused_kv_weight()  # every head layer's K/V of the new rows in one GEMM
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
        kv = self.head.context_kv(taps[None], positions[None].to(taps.device), self.kv_weight)
        loc = loc.long()
        for layer, (k, v) in enumerate(kv):
            self.k[layer][loc] = k[0].transpose(0, 1).to(self.k[layer].dtype)
            self.v[layer][loc] = v[0].transpose(0, 1).to(self.v[layer].dtype)

    def gather(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded context K/V of a batch (slots [b, L] from slots_of): per head layer (k, v) [b, Hkv, L, D]. Rows past
        a request's length read the padding slot (callers mask them)."""
        return [(k[slots].transpose(1, 2), v[slots].transpose(1, 2)) for k, v in zip(self.k, self.v)]
