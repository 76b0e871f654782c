"""The draft head's context K/V for b requests, in preallocated storage that grows geometrically.

Each head layer keeps keys and values [b, Hkv, capacity, D]; request i's valid rows are [0, lens[i]). Appending m rows
writes them in place (O(m) per round); the storage is reallocated, at twice the needed size, only when it is full, so
the total copying over a generation is O(final length).
"""
from __future__ import annotations

from typing import Sequence

import torch

MIN_CAPACITY = 64

KV = list[tuple[torch.Tensor, torch.Tensor]]


class ContextKV:
    def __init__(self, kv: KV, lens: Sequence[int] | None = None):
        """kv: per-layer (k, v) [b, Hkv, T, D] (rows past a request's length are ignored); lens: valid rows per request
        (default: T for every request)."""
        b, _, t, _ = kv[0][0].shape
        self.lens = [t] * b if lens is None else [int(n) for n in lens]
        if len(self.lens) != b or any(not 0 <= n <= t for n in self.lens):
            raise ValueError(f"lens {self.lens} do not fit {b} requests of {t} rows")
        self.device = kv[0][0].device
        self.store: KV = []
        cap = max(MIN_CAPACITY, 2 * t)
        for k, v in kv:
            sk = k.new_zeros(b, k.shape[1], cap, k.shape[3])
            sv = v.new_zeros(b, v.shape[1], cap, v.shape[3])
            sk[:, :, :t], sv[:, :, :t] = k, v
            self.store.append((sk, sv))

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def capacity(self) -> int:
        return self.store[0][0].shape[2]

    def lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.long, device=self.device)

    def views(self, rows: int | None = None) -> KV:
        """Per-layer (k, v) [b, Hkv, rows, D] views (default rows: the longest request), no copy."""
        t = max(self.lens) if rows is None else rows
        return [(k[:, :, :t], v[:, :, :t]) for k, v in self.store]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows per request: reallocate at twice that size when the storage is too small."""
        if rows <= self.capacity:
            return
        cap, used = max(2 * rows, MIN_CAPACITY), max(self.lens)
        grown = []
        for k, v in self.store:
            nk = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
            nv = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
            nk[:, :, :used], nv[:, :, :used] = k[:, :, :used], v[:, :, :used]
            grown.append((nk, nv))
        self.store = grown

    def append(self, kv: KV, counts: Sequence[int]) -> None:
        """kv: per-layer (k, v) [b, Hkv, m, D]; request i keeps its first counts[i] rows (the rest are written past
        its new length, where nothing reads them)."""
        m = kv[0][0].shape[2]
        counts = [int(c) for c in counts]
        if len(counts) != self.batch or any(not 0 <= c <= m for c in counts):
            raise ValueError(f"counts {counts} do not fit {self.batch} requests of {m} new rows")
        self.reserve(max(self.lens) + m)
        if self.batch == 1:
            n = self.lens[0]
            for (sk, sv), (k, v) in zip(self.store, kv):
                sk[:, :, n:n + m], sv[:, :, n:n + m] = k, v
        else:
            pos = self.lens_tensor()[:, None] + torch.arange(m, device=self.device)  # [b, m]
            for (sk, sv), (k, v) in zip(self.store, kv):
                idx = pos[:, None, :, None].expand(k.shape)
                sk.scatter_(2, idx, k)
                sv.scatter_(2, idx, v)
        self.lens = [n + c for n, c in zip(self.lens, counts)]

    def paged(self, rows: int):
        """One request's context as a paged pool over this storage (draft/paged.py): slot t is row t, and the head's
        block of up to `rows` rows is written past the context, in place (room is made first). Its shapes are fixed
        by the capacity, so a captured head forward replays until the storage grows (a new pool, a new capture)."""
        from jetflow_sglang.draft.paged import PagedContext, SlotPool

        if self.batch != 1:  # slot 0 is a real row here: a batch bucket's padded rows would write it
            raise ValueError(f"a paged context view holds one request, not {self.batch}")
        self.reserve(self.lens[0] + rows)
        if getattr(self, "_pool", None) is None or self._pool.k[0].data_ptr() != self.store[0][0].data_ptr():
            self._pool = SlotPool([k[0].transpose(0, 1) for k, _ in self.store],
                                  [v[0].transpose(0, 1) for _, v in self.store])  # [capacity, Hkv, D] views
        table = torch.arange(self.capacity, dtype=torch.int32, device=self.device)[None]
        return PagedContext(self._pool, table, torch.zeros(1, dtype=torch.long, device=self.device),
                            self.lens_tensor(), rows)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep requests `rows` (in that order), e.g. when others finished."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.store = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.store]
        self.lens = [self.lens[i] for i in rows]
