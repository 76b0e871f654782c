"""Captured round pieces: one runner, three back ends.

A piece is a function of tensors whose shapes are fixed by a key (its batch bucket, budget, ...): the head's forward
over a paged context, the tree build from its output, the acceptance. The runner keeps one capture per (piece, key)
over static input buffers. A call pads its batch to the bucket (copies of row 0, or a fill value: a padded row changes
no real row), copies the inputs in, replays, and returns the real rows of the outputs as tensors of their own (CUDA
graphs write into static buffers that the next replay overwrites, and a round's results can outlive it: SGLang's
overlap scheduler keeps the carry).

  cuda   torch.cuda.CUDAGraph: warm-up on a side stream, capture, replay (a GPU)
  fx     a fake-tensor ATen trace of the piece (make_fx), replayed: the CPU back end. The trace itself refuses a
         data-dependent op (item, nonzero, a boolean index); the scan then refuses every other op that makes the host
         wait (sync_ops.flag: multinomial, copies to the host, tensors from Python data). Same kernels as eager, so
         it proves the capture on a CPU rather than speeding it up
  eager  the piece itself, every call (capture off)

With check=True every replay is also compared with the eager piece on the same inputs, bit for bit (a test mode: it
runs each piece twice). A key is captured once, whatever its inputs' values: `captures` counts them.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from jetflow_sglang.core.sync_ops import flag

logger = logging.getLogger(__name__)
BACKENDS = ("eager", "fx", "cuda")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


class CaptureError(RuntimeError):
    """A piece that cannot be captured (a data-dependent op, a host wait), or a replay that differs from eager."""


def batch_bucket(b: int) -> int:
    """The smallest bucket holding b rows (b itself past the largest)."""
    return next((s for s in BATCH_BUCKETS if s >= b), b)


def default_backend(device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "fx"


def _pad(x: torch.Tensor, rows: int, fill=None) -> torch.Tensor:
    """x padded to `rows` rows: copies of row 0, or rows of `fill` (a piece whose padded rows must write nowhere
    real, e.g. the head's block slots: SGLang's padding slot 0)."""
    if x.shape[0] == rows:
        return x
    pad = x[:1].expand(rows - x.shape[0], *x.shape[1:]) if fill is None else \
        torch.full((rows - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], 0)


def scan(gm: torch.fx.GraphModule) -> list[str]:
    """The host waits and data-dependent shapes in a traced piece: sync_ops.flag over its ATen calls."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: _value(gm, a))
            why = flag(node.target, args, kwargs)
            if why is not None:
                found.append(f"{why}: {node.target}")
    return found


def _value(gm: torch.fx.GraphModule, a):
    """A traced argument's value: its fake tensor, or the constant tensor the graph holds."""
    if not isinstance(a, torch.fx.Node):
        return a
    return a.meta["val"] if "val" in a.meta else getattr(gm, a.target) if a.op == "get_attr" else None


class _Capture:
    """One piece at one key: static inputs, the replayable form, static outputs."""

    def __init__(self, backend: str, fn: Callable, inputs: list[torch.Tensor], pool=None):
        self.static = [x.clone() for x in inputs]
        if backend == "fx":
            fn(*self.static)  # warm-up, as CUDA's: host-side caches (a tree plan) fill with real tensors, not fakes
            from torch.fx.experimental.proxy_tensor import make_fx

            try:
                self.gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*self.static)
            except Exception as e:  # noqa: BLE001 (fake tensors refuse data-dependent ops with several types)
                raise CaptureError(f"{getattr(fn, '__name__', fn)} cannot be captured: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}") from e
            bad = scan(self.gm)
            if bad:
                raise CaptureError(f"{getattr(fn, '__name__', fn)} waits for the device: {'; '.join(bad)}")
            self.out = None
        else:  # cuda
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*self.static)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(self.graph, pool=pool):
                    self.out = fn(*self.static)
            except RuntimeError as e:  # a host wait inside the capture: CUDA refuses it
                raise CaptureError(f"{getattr(fn, '__name__', fn)} cannot be captured: {str(e).splitlines()[0]}") \
                    from e
        self.backend = backend

    def replay(self, inputs: list[torch.Tensor]) -> tuple:
        for s, x in zip(self.static, inputs):
            s.copy_(x)
        if self.backend == "fx":
            self.out = self.gm(*self.static)
        else:
            self.graph.replay()
        return tuple(self.out)


class GraphRunner:
    """run(name, key, fn, *inputs): fn(*inputs) with every input batch-leading [b, ...], replayed from its capture
    at (name, key, batch bucket). fn returns a tuple of batch-leading tensors; it must close over nothing that
    changes between calls of one key (the key says what it closes over), except buffers it writes in place and reads
    back (the head's KV pool), which the capture keeps as the same tensors. fill: {input index: value} for inputs
    whose padded rows take that value instead of row 0's."""

    def __init__(self, backend: str = "eager", check: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"graph back end must be one of {', '.join(BACKENDS)}; got {backend!r}")
        self.backend, self.check = backend, check
        self.captures: dict[tuple, _Capture] = {}
        self.refused: set[tuple] = set()  # keys whose capture failed (check=False): run eagerly, logged once
        self.replays = 0
        self.pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None

    def run(self, name: str, key: tuple, fn: Callable, *inputs: torch.Tensor, fill: dict | None = None) -> tuple:
        if self.backend == "eager":
            return tuple(fn(*inputs))
        b = inputs[0].shape[0]
        rows = batch_bucket(b)
        full = (name, key, rows)
        padded = [_pad(x, rows, (fill or {}).get(i)) for i, x in enumerate(inputs)]
        if full in self.refused:
            return tuple(fn(*inputs))
        cap = self.captures.get(full)
        if cap is None:
            try:
                cap = self.captures[full] = _Capture(self.backend, fn, padded, self.pool)
            except CaptureError as e:
                if self.check:
                    raise
                logger.error("JETFLOW graphs: %s; this shape runs eagerly", e)  # a served round never dies of it
                self.refused.add(full)
                return tuple(fn(*inputs))
        out = cap.replay(padded)
        self.replays += 1
        if self.check:
            want = fn(*padded)
            if len(want) != len(out) or not all(torch.equal(a, w) for a, w in zip(out, want)):
                raise CaptureError(f"{name} at {key}: the replay differs from the eager piece")
        if self.backend == "cuda":  # the graph's outputs live in its pool: the round's results outlive the next
            return tuple(o[:b].clone() for o in out)  # replay (a carry SGLang filters later), so they are copied
        return tuple(o[:b] for o in out)  # a replayed trace returns new tensors

    def snapshot(self) -> dict:
        return {"backend": self.backend, "captures": len(self.captures), "replays": self.replays,
                "refused": len(self.refused),
                "keys": sorted(f"{name} {key} x{rows}" for name, key, rows in self.captures)}
