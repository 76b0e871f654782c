"""What the host learns from a decode round, read a round later without stopping the device.

Each round runs its phases as `with readback.phase(name)` blocks (head, tree, verify, accept, commit) and pushes its
device values (the accepted node ids) at the end of the last; the phases' boundaries are its timing marks. On CUDA the values are copied to pinned host memory with `non_blocking=True` behind an event, and
the marks are CUDA events; `ready()` hands back only the rounds whose end event has completed (`Event.query()`,
which never waits), so the host never blocks on the device for statistics or the adaptive budget. On a CPU the
device is the host: the values are ready when pushed and the marks are `perf_counter` readings.

Host values are read from the completed host copies with `.numpy()` (the one place the round reads tensor values;
host_syncs.py counts every other way a round could wait for the device).
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PHASES = ("head", "tree", "verify", "accept", "commit")  # between consecutive marks: start, head done, tree built,
#                                                          verified, accepted, end
DRAFT = ("head", "tree")  # the drafting phases


@dataclass
class Round:
    budget: int  # the tree size this round verified (the adaptive budget's observations carry it)
    batch: int
    paths: list[list[int]]  # accepted node ids per request, root first, -1 padded
    split: dict  # seconds per phase: head (the head's forward and vocabulary projection), tree (top-k, tree build,
    #              prompt-lookup merge), verify (the target's forward), accept (penalties, grammar, acceptance),
    #              commit (KV moves, head rows, result)
    host_gap_s: float  # the host's time between the previous round's end and this round's start (the scheduler)

    @property
    def mean_accept(self) -> float:
        return sum(sum(1 for i in p if i >= 0) for p in self.paths) / max(1, len(self.paths))

    @property
    def draft_s(self) -> float:
        return sum(self.split[k] for k in DRAFT)

    @property
    def verify_s(self) -> float:  # everything after the draft: what the adaptive budget prices as the verify
        return sum(v for k, v in self.split.items() if k not in DRAFT)


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
        self.marks: list[_Mark] = []
        self._last_end: float | None = None  # host clock at the previous round's end

    @contextmanager
    def phase(self, name: str):
        """One phase of the round being run, in PHASES order (the first starts the round); its end is marked when the
        block ends, the last phase's by `push`, inside it."""
        if name == PHASES[0]:  # a round starts (a round that raised midway left its marks: dropped)
            self.marks = [_Mark(self.cuda)]
        expected = PHASES[len(self.marks) - 1] if len(self.marks) <= len(PHASES) else None
        if name != expected:
            raise RuntimeError(f"round phase {name!r} out of order: expected {expected!r}")
        yield
        if name != PHASES[-1]:
            self.marks.append(_Mark(self.cuda))

    def push(self, budget: int, batch: int, path: torch.Tensor) -> None:
        """Close the round being run (its last mark) and queue what the host will want from it. The copy is queued
        before the last mark is recorded, so that the mark's event completing means the copy has landed too."""
        host = path.to("cpu", non_blocking=True) if self.cuda else path
        if len(self.marks) != len(PHASES):
            raise RuntimeError(f"a round closed after {max(0, len(self.marks) - 1)} of its {len(PHASES)} phases")
        self.marks.append(_Mark(self.cuda))
        marks, self.marks = self.marks, []
        gap = marks[0].t - self._last_end if self._last_end is not None else 0.0
        self._last_end = marks[-1].t
        self.pending.append((budget, batch, host, marks, gap))
        while len(self.pending) > self.keep:
            self.pending.popleft()

    def ready(self) -> list[Round]:
        """Rounds whose values and timings are on the host by now, oldest first (never waits)."""
        out = []
        while self.pending and self.pending[0][3][-1].done():
            budget, batch, path, marks, gap = self.pending.popleft()
            split = {name: a.seconds_to(b) for name, a, b in zip(PHASES, marks, marks[1:])}
            out.append(Round(budget, batch, path.numpy().tolist(), split, gap))
        return out
