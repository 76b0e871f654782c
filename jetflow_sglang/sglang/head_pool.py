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

    def context(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, ctx_lens: torch.Tensor,
                max_len: int, rows: int, paged: bool):
        """The batch's context for the head: PagedContext (paged, `rows` block rows past each request) or the padded
        per-layer (k, v) of the first max_len tokens (a host bound on ctx_lens)."""
        if paged:
            return PagedContext(self, req_to_token, req_pool_indices, ctx_lens, rows)
        return self.gather(slots_of(req_to_token, req_pool_indices, ctx_lens, max_len))

    def gather(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded context K/V of a batch (slots [b, L] from slots_of): per head layer (k, v) [b, Hkv, L, D]. Rows past
        a request's length read the padding slot (callers mask them)."""
        return [(k[slots].transpose(1, 2), v[slots].transpose(1, 2)) for k, v in zip(self.k, self.v)]


class PagedContext(list):
    """One PagedLayer per head layer (what the head's forward zips with its layers), sharing the round's block table
    (req_to_token's rows of the batch: [b, row width], fixed per batch size), the context lengths and the block rows'
    slots. `padded()` gives the padded form, for the drafters' second forwards (the branch trees: 2N rows)."""
    paged = True

    def __init__(self, pool: HeadKVPool, req_to_token, req_pool_indices, ctx_lens, rows: int):
        table = req_to_token.index_select(0, req_pool_indices.long())  # int32 [b, W]: slot of each position
        cols = ctx_lens.long()[:, None] + torch.arange(int(rows), device=ctx_lens.device)
        self._set(pool, table, ctx_lens.to(torch.int32), table.gather(1, cols).long())

    def _set(self, pool: HeadKVPool, table, lens, block_slots) -> None:
        self.pool, self.table, self.lens = pool, table, lens
        self.block_slots, self.rows = block_slots, block_slots.shape[1]  # [b, rows]: the slots reserved this round
        self[:] = [PagedLayer(self, k, v) for k, v in zip(pool.k, pool.v)]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table, lens, block_slots): everything of the round in it, batch-leading (a captured head's inputs)."""
        return self.table, self.lens, self.block_slots

    def like(self, table, lens, block_slots) -> "PagedContext":
        """The same pool with another round's tensors (a captured head forward's static inputs)."""
        ctx = PagedContext.__new__(PagedContext)
        ctx._set(self.pool, table, lens, block_slots)
        return ctx

    def padded(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        width = self.table.shape[1]
        cols = torch.arange(width, device=self.table.device)[None]
        return self.pool.gather(torch.where(cols < self.lens[:, None], self.table.long(), 0))


class PagedLayer:
    def __init__(self, ctx: PagedContext, k: torch.Tensor, v: torch.Tensor):
        self.ctx, self.k, self.v = ctx, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [b, H, S, D], the block's k/v [b, Hkv, S, D], mask [b, S, S] (the block's own) -> [b, H, S, D]: every
        row sees its request's context (ctx_lens) and the block rows the mask allows."""
        from jetflow_sglang.core.tree import pack_bits
        from jetflow_sglang.kernels.triton_tree_attn import tree_attention

        ctx = self.ctx
        b, h, s, d = q.shape
        if s > ctx.rows:
            raise ValueError(f"a head block of {s} rows does not fit the {ctx.rows} reserved past each request")
        slots = ctx.block_slots[:, :s]
        self.k[slots] = k.transpose(1, 2).to(self.k.dtype)  # [b, S, Hkv, D] into the reserved rows
        self.v[slots] = v.transpose(1, 2).to(self.v.dtype)
        qo = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        out = tree_attention(q.transpose(1, 2).reshape(b * s, h, d).to(self.k.dtype).contiguous(),
                             self.k.unsqueeze(1), self.v.unsqueeze(1), ctx.table, ctx.lens, qo,
                             pack_bits(mask.reshape(b * s, s)), max_q=s)
        return out.view(b, s, h, d).transpose(1, 2).to(q.dtype)
