"""What the host learns from a decode round, read a round later without stopping the device.

Each round pushes its device values (the accepted node ids) and its timing marks. On CUDA the values are copied to
pinned host memory with `non_blocking=True` behind an event, and the round's start / draft-done / end marks are CUDA
events; `ready()` hands back only the rounds whose end event has completed (`Event.query()`, which never waits), so
the host never blocks on the device for statistics or the adaptive budget. On a CPU the device is the host: the
values are ready when pushed and the marks are `perf_counter` readings.

Host values are read from the completed host copies with `.numpy()` (the one place the round reads tensor values;
tests/sglang/test_host_syncs.py counts every other way a round could wait for the device).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Round:
    budget: int  # the tree size this round verified (the adaptive budget's observations carry it)
    batch: int
    paths: list[list[int]]  # accepted node ids per request, root first, -1 padded

    @property
    def mean_accept(self) -> float:
        return sum(sum(1 for i in p if i >= 0) for p in self.paths) / max(1, len(self.paths))
    draft_s: float  # head forward + tree build (+ lookup)
    verify_s: float  # target verify + acceptance + commit


class _Mark:
    """A point in the device's timeline: a CUDA event, or perf_counter on a CPU."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def seconds_to(self, later: "_Mark") -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.t - self.t

    def done(self) -> bool:
        return self.event is None or self.event.query()


class Readback:
    def __init__(self, device, keep: int = 8):
        self.cuda = str(device).startswith("cuda")
        self.keep = keep  # rounds in flight at most; older unread ones are dropped (statistics only)
        self.pending: deque = deque()

    def mark(self) -> _Mark:
        return _Mark(self.cuda)

    def push(self, budget: int, batch: int, path: torch.Tensor, start: _Mark, drafted: _Mark) -> None:
        host = path.to("cpu", non_blocking=True) if self.cuda else path
        self.pending.append((budget, batch, host, start, drafted, self.mark()))
        while len(self.pending) > self.keep:
            self.pending.popleft()

    def ready(self) -> list[Round]:
        """Rounds whose values and timings are on the host by now, oldest first (never waits)."""
        out = []
        while self.pending and self.pending[0][-1].done():
            budget, batch, path, start, drafted, end = self.pending.popleft()
            out.append(Round(budget, batch, path.numpy().tolist(), start.seconds_to(drafted), drafted.seconds_to(end)))
        return out
