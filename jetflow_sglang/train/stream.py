"""Training records read from regeneration JSONL files as they are consumed (the online teacher's data path).

Nothing loads a file whole: a reader holds one window of raw lines, so a file larger than memory trains.

The rule (one global order, whatever the world size):
  order     Epoch e = 0, 1, ... walks the files in the order given. Its training records (those `keep` accepts;
            held-out records never train) are cut into consecutive windows of `window` records, and each window is
            shuffled with random.Random(f"{seed}/{e}/{w}"). g_0, g_1, ... is these windows one after the other, epoch
            after epoch. The window bounds memory; a file that is sorted (e.g. by source) mixes only within a window.
  shards    Each step takes the next world x seqs records of g. Rank r of N gets the records at offsets
            r, r + N, r + 2N, ... of that slice (every world-th record, as dist.shard splits the offline cache).
            Every rank reads every line; it parses in full only its own records.
  position  `consumed` (records of g taken by all ranks together) plus where the current window starts in the files.
            It is the same on every rank, so rank 0's copy goes into the checkpoint. A resumed run of any world size
            continues with g_consumed: on the same world size each rank reads exactly the records it would have read
            next; on another one the global sequence is the same and only its split over the ranks differs.
            The window size, the seed and the files are part of the order, so a resume with other ones is refused.
"""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Callable, Iterator


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _parse(line: bytes) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # a torn last line from a killed regeneration run, as data.read_records ignores
        return None


def iter_records(paths) -> Iterator[dict]:
    """Every complete record of the files, one line at a time."""
    for p in paths:
        with _open(str(p)) as f:
            for line in f:
                rec = _parse(line)
                if rec is not None:
                    yield rec


class RecordStream:
    """The global order g of the module docstring, read lazily; `take(n)` returns the next n records' raw lines."""

    def __init__(self, paths, keep: Callable[[dict], bool] = lambda r: True, window: int = 4096, seed: int = 0):
        if window < 1:
            raise ValueError("the shuffle window needs at least one record")
        self.paths, self.keep, self.window, self.seed = [str(p) for p in paths], keep, window, seed
        self.consumed = 0  # records of g taken so far
        self.epoch = self.win = 0  # the current window: its epoch and index within the epoch ...
        self.file = self.offset = 0  # ... the file and byte offset where it starts ...
        self.index = 0  # ... and how many of its records are taken
        self.bytes_read = 0  # raw bytes read from the files (tests check that reading follows consumption)
        self._lines: list[bytes] | None = None
        self._next = (0, 0)  # (file, offset) of the window after this one

    def _fill(self) -> None:
        lines, f_i, off = [], self.file, self.offset
        while len(lines) < self.window and f_i < len(self.paths):
            with _open(self.paths[f_i]) as f:
                f.seek(off)
                eof = False
                while len(lines) < self.window:
                    line = f.readline()
                    if not line:
                        eof = True
                        break
                    self.bytes_read += len(line)
                    rec = _parse(line)
                    if rec is not None and self.keep(rec):
                        lines.append(line)
                off = f.tell()
            if eof:
                f_i, off = f_i + 1, 0
        if not lines:  # the files are done: the next epoch starts at the top
            if self.win == 0:
                raise ValueError(f"no training records in {self.paths}")
            self.epoch, self.win, self.file, self.offset = self.epoch + 1, 0, 0, 0
            return self._fill()
        order = list(range(len(lines)))
        random.Random(f"{self.seed}/{self.epoch}/{self.win}").shuffle(order)
        self._lines, self._next = [lines[i] for i in order], (f_i, off)

    def take(self, n: int) -> list[bytes]:
        out = []
        while len(out) < n:
            if self._lines is None:
                self._fill()
            if self.index == len(self._lines):  # window used up: the next one starts where this one ended
                self.win, (self.file, self.offset), self.index, self._lines = self.win + 1, self._next, 0, None
                continue
            out.append(self._lines[self.index])
            self.index += 1
            self.consumed += 1
        return out

    def take_shard(self, per_rank: int, rank: int, world: int) -> list[dict]:
        """One step: the next world x per_rank records of g, of which this rank parses and returns its own."""
        return [json.loads(line) for line in self.take(per_rank * world)[rank::world]]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "epoch": self.epoch, "window_index": self.win, "file": self.file,
                "offset": self.offset, "index": self.index, "window": self.window, "seed": self.seed,
                "files": [Path(p).name for p in self.paths]}

    def load_state_dict(self, st: dict) -> None:
        mine = self.state_dict()
        for key in ("window", "seed", "files"):
            if st[key] != mine[key]:
                raise ValueError(f"the saved data position was made with {key} {st[key]!r}, not {mine[key]!r}: the "
                                 f"record order would differ (resume with the same --data, --stream-window, --seed)")
        self.consumed, self.epoch, self.win = st["consumed"], st["epoch"], st["window_index"]
        self.file, self.offset, self.index, self._lines = st["file"], st["offset"], st["index"], None
