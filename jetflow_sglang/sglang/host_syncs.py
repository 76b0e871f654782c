"""Counting the points where a decode round could make the host wait for the device (JETFLOW_COUNT_SYNCS=1).

While a round runs, every call that reads tensor values on the host or copies host data to the device is counted
with its call site: `Tensor.item`, `.tolist`, `.cpu`, `bool()` / `int()` / `float()` / `index()` of a tensor (truth
tests included), and `torch.tensor` / `torch.as_tensor` from Python data (a blocking host-to-device copy on a GPU).
On a GPU each is a synchronisation; on a CPU the same calls are counted, so CI checks the structure of the round
without a GPU. The one sanctioned read, the statistics readback of an earlier round (readback.py), reads completed
host copies with `.numpy()` and is not counted. The counter wraps the worker's round only, not SGLang's scheduler.
The benchmark and tests read the counts from /server_info (internal_states[i]["jetflow"]["host_syncs"]).
"""
from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

import torch

METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
FACTORIES = ("tensor", "as_tensor")


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


class SyncCounter:
    def __init__(self, keep: int = 256):
        self.keep = keep
        self.rounds: list[dict] = []  # newest last: {"batch", "syncs", "sites", "grammar", "penalties"}

    @contextmanager
    def round(self, batch: int, grammar: bool, penalties: bool):
        sites: Counter = Counter()
        saved = {name: getattr(torch.Tensor, name) for name in METHODS}
        saved_f = {name: getattr(torch, name) for name in FACTORIES}

        def counted(name, fn):
            def wrapper(*args, **kwargs):
                sites[f"{name} {_site()}"] += 1
                return fn(*args, **kwargs)
            return wrapper

        def factory(name, fn):
            def wrapper(data, *args, **kwargs):
                if not isinstance(data, torch.Tensor):
                    sites[f"torch.{name} {_site()}"] += 1
                return fn(data, *args, **kwargs)
            return wrapper

        for name, fn in saved.items():
            setattr(torch.Tensor, name, counted(name, fn))
        for name, fn in saved_f.items():
            setattr(torch, name, factory(name, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)
            for name, fn in saved_f.items():
                setattr(torch, name, fn)
            self.rounds = (self.rounds + [{"batch": batch, "syncs": sum(sites.values()), "sites": dict(sites),
                                           "grammar": grammar, "penalties": penalties}])[-self.keep:]

    def snapshot(self) -> dict:
        plain = [r for r in self.rounds if not (r["grammar"] or r["penalties"])]
        recent = plain[-64:]  # the steady state (the first rounds after a start read the KV pool's pointers once)
        return {"rounds": len(self.rounds), "max_plain": max((r["syncs"] for r in plain), default=None),
                "mean_plain": round(sum(r["syncs"] for r in recent) / len(recent), 3) if recent else None,
                "recent": self.rounds[-64:]}
