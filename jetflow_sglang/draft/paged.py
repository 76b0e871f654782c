"""The head's context read in place: a pool of per-slot K/V rows and a block table, the paged form of the head's
attention (the server's HeadKVPool, sglang/head_pool.py; the engine's ContextKV.paged, for one request).

The block's queries attend to the pool's rows through the Triton tree-attention kernel (kernels/triton_tree_attn.py,
page size 1, a block table of slots). The block's own K/V is written to the slots reserved past each request, so
nothing is gathered or concatenated and every shape is fixed by the batch, the block and the table's width: what a
captured head forward needs (core/graphs.py). Triton runs on a GPU, or on a CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import itertools

import torch

_SERIAL = itertools.count()


class SlotPool:
    """Per-layer key and value rows [size, Hkv, D], one row per slot (slot 0: padding, written by padded rows).
    `serial` names this pool's storage in a captured head's key: a capture writes and reads these very tensors."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v, self.serial = k, v, next(_SERIAL)

    def gather(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Padded context K/V of a batch (slots [b, L]): per head layer (k, v) [b, Hkv, L, D]. Rows past a request's
        length read the padding slot (callers mask them)."""
        return [(k[slots].transpose(1, 2), v[slots].transpose(1, 2)) for k, v in zip(self.k, self.v)]


class PagedContext(list):
    """One PagedLayer per head layer (what the head's forward zips with its layers), sharing the round's block table
    (req_to_token's rows of the batch: [b, row width], fixed per batch size), the context lengths and the block rows'
    slots. `padded()` gives the padded form, for the drafters' second forwards (the branch trees: 2N rows)."""
    paged = True

    def __init__(self, pool: SlotPool, req_to_token, req_pool_indices, ctx_lens, rows: int):
        table = req_to_token.index_select(0, req_pool_indices.long())  # int32 [b, W]: slot of each position
        cols = ctx_lens.long()[:, None] + torch.arange(int(rows), device=ctx_lens.device)
        self._set(pool, table, ctx_lens.to(torch.int32), table.gather(1, cols).long())

    def _set(self, pool: SlotPool, table, lens, block_slots) -> None:
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
