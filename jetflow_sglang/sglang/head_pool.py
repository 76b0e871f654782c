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

The head reads its context in one of two ways (HeadKVPool.context):
- padded: every layer's rows of the batch gathered into [b, Hkv, L, D] (L: the longest context), then concatenated
  with the block's own K/V for one dense attention. The copy grows with batch x context and its shapes change every
  round: the CPU path, where the gather is the attention's own memory read.
- paged (PagedContext): the block's queries attend to the pool's rows in place through the Triton tree-attention
  kernel (kernels/triton_tree_attn.py; page size 1, SGLang's req_to_token rows as the block table). The block's own
  K/V is written to the pool rows of the slots SGLang reserved for this round past each request (the verify window:
  the commit overwrites the accepted ones), so nothing is gathered or concatenated, and every shape is fixed by the
  batch, the block and the pool: the GPU path (and a CPU server under TRITON_INTERPRET=1 on jetflow_tree_triton).
  PagedContext lives in draft/paged.py, which the standalone engine shares.
"""
from __future__ import annotations

import torch

from jetflow_sglang.draft.paged import PagedContext, SlotPool


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


class HeadKVPool(SlotPool):
    def __init__(self, head, size: int, device, dtype=None):
        cfg = head.config
        self.head = head
        self.kv_weight = head.fused_kv_weight()  # every head layer's K/V of the new rows in one GEMM
        self.size = int(size)
        self.layers = cfg.num_layers
        dtype = dtype or head.fc.weight.dtype
        shape = (self.size, cfg.num_kv_heads, cfg.head_dim)
        super().__init__([torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)],
                         [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.layers)])

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

    def context(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, ctx_lens: torch.Tensor,
                max_len: int, rows: int, paged: bool):
        """The batch's context for the head: PagedContext (paged, `rows` block rows past each request) or the padded
        per-layer (k, v) of the first max_len tokens (a host bound on ctx_lens)."""
        if paged:
            return PagedContext(self, req_to_token, req_pool_indices, ctx_lens, rows)
        return self.gather(slots_of(req_to_token, req_pool_indices, ctx_lens, max_len))

