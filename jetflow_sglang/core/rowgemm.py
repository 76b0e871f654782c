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
    activate(on)     take the transposed product at all in this process (default on); `profiling.tune_gemm` measures
                     a real verify both ways once per machine and model and switches it off where it loses

Whether it pays depends on the CPU's BLAS kernels, so the engine measures it rather than assuming it: on a 2-core Intel
Xeon with AVX-512 and AMX (2026-12-03) it lost at every size, a 4-node float32 verify 79 ms against 51 ms stock and one
token 34 ms (`bench/results/rowgemm_xeon_amx.md`), where on the AVX2 EPYC above it won 1.3-1.8x.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_FLAG = "_jetflow_rowgemm"
MAX_ROWS = 1024  # measured up to 256 rows (still ahead there); larger products (training, long prefills) stay stock
_ACTIVE = True


def activate(on: bool) -> None:
    """Take the transposed product for enabled layers and bare weights (True, the default) or never (False)."""
    global _ACTIVE
    _ACTIVE = bool(on)


def active() -> bool:
    return _ACTIVE


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           contiguous: bool = False, min_rows: int = 1) -> torch.Tensor:
    """F.linear(x, weight, bias); rows > 1 on CPU as W @ X^T (a different rounding order, not different maths).

    The result is then a transposed view (strides (1, rows)): torch ops take it as it is, but a kernel that assumes
    row-major memory (SGLang's grammar bitmask, C++ CPU ops) needs contiguous=True (one copy of the output).
    min_rows > 1: fewer rows are padded with zero rows, so BLAS takes the same kernel (and rounding) for every row
    count (`exact` rows)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows < min_rows:
        flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, min_rows - rows))
        return linear(flat, weight, bias, contiguous)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    if not _ACTIVE or not 1 < rows <= MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 \
            or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    out = out.t().contiguous() if contiguous else out.t()
    return out.reshape(*x.shape[:-1], weight.shape[0])


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
