"""Multi-row linear layers on CPU as W @ X^T: the GEMM shape that a verify forward needs, at the weights' bandwidth.

A tree verify multiplies every weight matrix by a handful of rows (the tree's nodes). On a CPU, `F.linear` with
2-32 rows (MKL's x @ W^T) costs 1.7-3x the one-row product, although both read each weight once; the transposed
product W @ X^T streams the weights once and costs about as much as one row up to ~32 rows (SmolLM2-135M, float32,
2 cores of an AVX2 EPYC: all 211 linears of a 16-row forward 145 ms -> 94 ms; one row 66 ms either way;
`scripts/bench_rowgemm.py`). One row keeps `F.linear`, so plain decoding is bit-for-bit what it was.
Only float32 takes this path. In bfloat16 on a CPU that computes it natively (AVX512-BF16, AMX), oneDNN's small-row
kernels are already flat, and W @ X^T was slower: 0.64x at 4 rows, 0.83x at 16 and 0.93x at 32, on a 2-core EPYC
with AVX512-BF16, where the same product in float32 was 1.71x / 1.22x / 1.13x faster (2026-12-02).

    enable(model)    every nn.Linear of the model computes multi-row inputs as W @ X^T (idempotent)
    disable(model)   back to stock nn.Linear.forward (benchmarks time Hugging Face's own paths this way)
    linear(x, w)     the same product for a bare weight (the draft head's reduced-vocabulary projection)
    tune(weights)    measure, per weight shape, up to how many rows W @ X^T beats F.linear on this machine (cached on
                     disk per CPU model, thread count and torch version); linear() then takes it only there
    activate(on)     take the transposed product at all in this process (default on)

Whether it pays depends on the CPU's BLAS kernels and on the shape, so it is measured rather than assumed:
- on a 2-core Intel Xeon with AVX-512 and AMX (2026-12-03) it lost at every size, a 4-node float32 verify 79 ms
  against 51 ms stock (`bench/results/rowgemm_xeon_amx.md`), where on the AVX2 EPYC above it won 1.3-1.8x;
- on a 2-core AVX512-BF16 EPYC, one thread (2026-12-05), it won 1.4-2.5x on every SmolLM2-135M weight at 2-4 rows,
  was about even at 8 and lost 5-10% from 16 rows on; a SGLang verify of 32 rows (4 requests x 8) ran 7-9% behind
  SGLang's DFLASH, which keeps stock F.linear, until the server measured this.
A whole-verify on/off switch (the engine's earlier choice) cannot keep the small products and drop the large ones.
The measurement streams the weights from memory, as a forward does: timed on one cache-resident weight, the same EPYC
showed F.linear ahead at 2-8 rows, and a server following that ran its default 20-25% slower in float32.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

_FLAG = "_jetflow_rowgemm"
ROWS = (2, 4, 8, 16, 32, 64)  # the row counts tune() measures, rising until W @ X^T first loses
MAX_ROWS = 1024  # larger products (training, long prefills) stay stock; a shape still ahead at ROWS[-1] goes to here
MARGIN = 1.1  # W @ X^T must be this much faster than F.linear to be taken (a smaller gain is within noise)
_ACTIVE = True
_LIMIT: dict[tuple[int, int], int] = {}  # float32 weight shape -> most rows W @ X^T takes (0: never); untuned: MAX_ROWS


def activate(on: bool) -> None:
    """Take the transposed product for enabled layers and bare weights (True, the default) or never (False)."""
    global _ACTIVE
    _ACTIVE = bool(on)


def active() -> bool:
    return _ACTIVE


# oneDNN's bfloat16 GEMM on an AMX Xeon switches kernels above 32 rows for some weight shapes (SmolLM2's MLP
# up-projection and LM head), which round differently; chunks of up to 32 rows matched a padded one-row product bit
# for bit there (2026-12-06), and on an AVX512-BF16 EPYC every count from 4 rows up did.
EXACT_MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           contiguous: bool = False, min_rows: int = 1) -> torch.Tensor:
    """F.linear(x, weight, bias); rows > 1 on CPU as W @ X^T (a different rounding order, not different maths).

    The result is then a transposed view (strides (1, rows)): torch ops take it as it is, but a kernel that assumes
    row-major memory (SGLang's grammar bitmask, C++ CPU ops) needs contiguous=True (one copy of the output).
    min_rows > 1: fewer rows are padded with zero rows, and more than EXACT_MAX_ROWS are multiplied in chunks of
    that many, so BLAS takes the same kernel (and rounding) for every row count (`exact` rows)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if min_rows > 1 and rows > EXACT_MAX_ROWS:  # exact rows: every chunk takes the kernel of a padded one-row step
        flat = x.reshape(rows, x.shape[-1])
        parts = [linear(flat[k:k + EXACT_MAX_ROWS], weight, bias, contiguous, min_rows)
                 for k in range(0, rows, EXACT_MAX_ROWS)]
        return torch.cat(parts).reshape(*x.shape[:-1], weight.shape[0])
    if 0 < rows < min_rows:
        flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, min_rows - rows))
        return linear(flat, weight, bias, contiguous)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    if not _ACTIVE or not 1 < rows <= _LIMIT.get(weight.shape, MAX_ROWS) or x.device.type != "cpu" \
            or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    out = out.t().contiguous() if contiguous else out.t()
    return out.reshape(*x.shape[:-1], weight.shape[0])


COLD_BYTES = 64 << 20  # a measurement streams this many bytes of weight copies: more than the CPU's caches hold


def _best_of(fn, reps: int) -> float:
    fn()  # warm-up (allocation, kernel selection)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(weight: torch.Tensor, rows: int, reps: int = 2) -> tuple[float, float]:
    """(F.linear seconds, W @ X^T seconds) for `rows` random rows through copies of this weight, best of reps each.

    In a forward every weight is read once, from memory; the products run over COLD_BYTES of copies so that they
    do too. (Timed on one cache-resident weight instead, F.linear won at 2-8 rows on an AVX512-BF16 EPYC, where in
    the model W @ X^T won 1.4-2.5x there.)"""
    copies = [weight.clone() for _ in range(max(1, min(512, COLD_BYTES // max(1, weight.numel() * 4))))]
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)

    def stock():
        for w in copies:
            F.linear(x, w)

    def transposed():
        for w in copies:
            torch.mm(w, x.t()).t().contiguous()

    return _best_of(stock, reps), _best_of(transposed, reps)


def tune(weights: Iterable[torch.Tensor], cache_file: str | Path | None = None, machine: str = "",
         reps: int = 2) -> dict:
    """For each distinct float32 CPU weight shape, the most rows (of ROWS, rising until it first loses) at which
    W @ X^T is MARGIN faster than F.linear; linear() takes the transposed product only up to there. Shapes found in
    `cache_file` under this machine (its CPU: machine.cpu_kind(), given by the caller), thread count and torch version
    are not measured again. Returns the limits."""
    todo = {tuple(w.shape): w for w in weights
            if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"}
    key = f"{machine} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    stored = {}
    if cache_file is not None:
        try:
            stored = json.loads(Path(cache_file).read_text()).get(key, {})
        except (OSError, ValueError):
            stored = {}
    fresh = False
    for shape, w in todo.items():
        name = f"{shape[0]}x{shape[1]}"
        if name in stored:
            _LIMIT[shape] = int(stored[name])
            continue
        limit = 0
        for rows in ROWS:
            stock, transposed = measure(w, rows, reps)
            if transposed * MARGIN > stock:
                break
            limit = rows
        _LIMIT[shape] = stored[name] = MAX_ROWS if limit == ROWS[-1] else limit
        fresh = True
    if fresh and cache_file is not None:
        _save(Path(cache_file), key, stored)
    return {s: _LIMIT[s] for s in todo}


def _save(path: Path, key: str, limits: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = limits
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


def limits() -> dict[tuple[int, int], int]:
    """The measured row limits so far (shape -> rows); shapes not in it take W @ X^T up to MAX_ROWS."""
    return dict(_LIMIT)


def set_limits(table: dict[tuple[int, int], int]) -> None:
    """Replace the measured limits (benchmarks time the transposed product itself with {})."""
    _LIMIT.clear()
    _LIMIT.update({tuple(k): int(v) for k, v in table.items()})


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, min_rows=getattr(self, "_jetflow_min_rows", 1))


def enable(model: nn.Module) -> nn.Module:
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and not getattr(mod, _FLAG, False):
            mod.forward = _forward.__get__(mod)
            setattr(mod, _FLAG, True)
    return model


def disable(model: nn.Module) -> nn.Module:
    for mod in model.modules():
        if getattr(mod, _FLAG, False):
            del mod.forward  # the instance attribute; nn.Linear.forward shows through again
            setattr(mod, _FLAG, False)
    return model


def enabled(model: nn.Module) -> bool:
    return any(getattr(m, _FLAG, False) for m in model.modules())
