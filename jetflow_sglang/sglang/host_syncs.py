"""What a decode round makes the host wait for, seen at the dispatch level (JETFLOW_COUNT_SYNCS=1).

While a round runs (the worker's step and SGLang's target forward inside it), a TorchDispatchMode sees every ATen op
and flags those that read device values on the host or whose output shape depends on device data:
  _local_scalar_dense   item(), bool(), int(), float() of a tensor, truth tests
  nonzero, masked_select, a boolean index (index / index_put), unique, repeat_interleave without output_size,
  multinomial           (its kernel reads a count back)
  lift_fresh            a tensor made from Python data (a blocking host-to-device copy on a GPU); a 0-dim one,
                        a Python scalar written into a tensor, is a fill on the device and is not flagged
  a copy to the host    a blocking _to_copy / copy_ from another device onto the CPU
Two host reads never reach the dispatcher when the tensors already live on the CPU, `Tensor.tolist()` and
`Tensor.cpu()`, so they are counted at the Python level: CI checks the structure of a GPU round on a CPU. The one
sanctioned read, the statistics readback of an earlier round (readback.py), reads completed host copies with
`.numpy()` and is not counted.

Each round also records its op sequence (names) and its shape sequence (names and output shapes), hashed: rounds of
one (batch, budget) key that a graph could replay run the same op sequence, and the same shapes. The snapshot
reports, per key, how many distinct sequences were seen and which ops' shapes changed. Tests and the benchmark read
it from /server_info (internal_states[i]["jetflow"]["host_syncs"]).
"""
from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jetflow_sglang.core.sync_ops import PYTHON_LEVEL, flag  # noqa: F401  (flag: the tests' import)

def _site() -> str:
    """file:line of the innermost caller outside this module and torch."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or "/torch/" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    for root in ("jetflow_sglang/", "sglang/"):
        if root in name:
            name = name[name.rindex(root):]
            break
    return f"{name}:{f.f_lineno}"


def _shapes(out) -> tuple:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        return tuple(tuple(o.shape) for o in out if isinstance(o, torch.Tensor))
    return ()


class _Watch(TorchDispatchMode):
    def __init__(self, sites: Counter):
        super().__init__()
        self.sites, self.ops, self.shapes = sites, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = flag(func, args, kwargs)
        if why is not None:
            self.sites[f"{why} {_site()}"] += 1
        out = func(*args, **kwargs)
        name = str(func)
        self.ops.append(name)
        self.shapes.append((name, _shapes(out)))
        return out


class SyncCounter:
    def __init__(self, keep: int = 256):
        self.keep = keep
        self.rounds: list[dict] = []  # newest last: {"n", "batch", "budget", "syncs", "sites", "grammar", "penalties", ...}
        self._seen: dict[tuple, dict] = {}  # (batch, budget) -> {"ops", "shapes": hashes, "first": {ops: shapes}}
        self._budget, self.count = None, 0  # count: rounds ever recorded (a round's "n" is its place in it)

    def tag(self, budget: int) -> None:
        """The round's budget (its key with the batch size), once the worker has chosen it."""
        self._budget = int(budget)

    @contextmanager
    def round(self, batch: int, grammar: bool, penalties: bool):
        sites: Counter = Counter()
        saved = {name: getattr(torch.Tensor, name) for name in PYTHON_LEVEL}

        def counted(name, fn):
            def wrapper(*args, **kwargs):
                sites[f"{name} {_site()}"] += 1
                return fn(*args, **kwargs)
            return wrapper

        for name, fn in saved.items():
            setattr(torch.Tensor, name, counted(name, fn))
        self._budget, watch = None, _Watch(sites)
        try:
            with watch:
                yield
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)
            self._record(batch, grammar, penalties, sites, watch)

    def _record(self, batch, grammar, penalties, sites, watch) -> None:
        key = (batch, self._budget)
        ops, shapes = hash(tuple(watch.ops)), hash(tuple(watch.shapes))
        if not (grammar or penalties):  # those rounds run extra host work by design
            seen = self._seen.setdefault(key, {"ops": set(), "shapes": set(), "first": {}, "varying": set()})
            seen["ops"].add(ops)
            seen["shapes"].add(shapes)
            first = seen["first"].setdefault(ops, watch.shapes)  # the first round of this op sequence
            seen["varying"] |= {a[0] for a, b in zip(watch.shapes, first) if a != b}
        self.count += 1
        self.rounds = (self.rounds + [{"n": self.count, "batch": batch, "budget": self._budget, "syncs": sum(sites.values()),
                                       "sites": dict(sites), "grammar": grammar, "penalties": penalties,
                                       "ops": len(watch.ops), "op_sequence": ops}])[-self.keep:]

    def snapshot(self) -> dict:
        plain = [r for r in self.rounds if not (r["grammar"] or r["penalties"])]
        recent = plain[-64:]  # the steady state (the first rounds after a start read the KV pool's pointers once)
        keys = {f"{b}x{n}": {"op_sequences": len(s["ops"]), "shape_sequences": len(s["shapes"]),
                             "ops_with_varying_shapes": sorted(s["varying"])} for (b, n), s in self._seen.items()}
        return {"rounds": self.count, "max_plain": max((r["syncs"] for r in plain), default=None),
                "mean_plain": round(sum(r["syncs"] for r in recent) / len(recent), 3) if recent else None,
                "keys": keys, "recent": self.rounds[-64:]}
