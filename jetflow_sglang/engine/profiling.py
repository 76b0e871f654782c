"""Machine profiling for the standalone engine: the verify-cost prior that `auto` starts from, and the per-machine
choice of row GEMMs. Both are measured once per model, dtype and machine and cached under paths.cache_dir().

The controller itself (core/budget.py) takes any {tokens: seconds} prior and measures nothing."""
from __future__ import annotations

import json
import os
import time
from typing import Sequence

from jetflow_sglang.core import rowgemm
from jetflow_sglang.core.budget import AdaptiveBudget
from jetflow_sglang.core.tree import DraftTree, check_budget
from jetflow_sglang.machine import cpu_kind, tune_rowgemm
from jetflow_sglang.paths import cache_dir

PRIOR_SIZES = (1, 4, 16, 64)
_MEMO: dict[str, dict[int, float]] = {}


def profile_key(target) -> str:
    """Model shape + dtype + device + machine: what a verify cost depends on."""
    import torch

    cfg = target.config
    dev = target.device
    fields = {
        "model": getattr(cfg, "_name_or_path", "") or "",
        "shape": [getattr(cfg, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                                                   "num_attention_heads", "num_key_value_heads", "vocab_size")],
        "dtype": str(target.dtype), "device": str(dev),
        "accel": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_kind(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        # the verify kernels change its cost (rowgemm only takes float32 products)
        "gemm": _gemm_kind(target),
    }
    return json.dumps(fields, sort_keys=True)


def _profile_path():
    return cache_dir() / "cost_profile.json"


def _load_profiles() -> dict:
    try:
        return json.loads(_profile_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_profile(key: str, prof: dict[int, float]) -> None:
    path = _profile_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_profiles()
        data[key] = {str(k): v for k, v in prof.items()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


def measure_cost_prior(target, sizes: Sequence[int] = PRIOR_SIZES, reps: int = 5, cache: bool = True,
                       refresh: bool = False) -> dict[int, float]:
    """{tree size: seconds} of target.verify (min of reps, sizes interleaved) after a short prefill.

    Cached in memory, and on disk under paths.cache_dir() for named checkpoints, keyed by `profile_key`.
    refresh=True measures again and replaces the cached profile (benchmarks: a profile taken on a busy machine
    would skew the first rounds of `auto`). Leaves the target's KV cache in a scratch state: prefill again.
    """
    sizes = sorted({check_budget(int(n)) for n in sizes})
    key = profile_key(target)
    persist = cache and bool(getattr(target.config, "_name_or_path", ""))
    stored = None if refresh else _MEMO.get(key) or (_load_profiles().get(key) if persist else None)
    if stored and all(str(n) in stored or n in stored for n in sizes):
        prof = {int(k): float(v) for k, v in stored.items()}
        _MEMO[key] = prof
        return {n: prof[n] for n in sizes}
    prof = _time_verify(target, sizes, reps)
    if cache:
        _MEMO[key] = prof
    if persist:
        _save_profile(key, prof)
    return prof


def _time_verify(target, sizes: list[int], reps: int, warmup: int = 2) -> dict[int, float]:
    import torch

    vocab = int(target.config.vocab_size)
    prompt = [(7 * i + 3) % vocab for i in range(64)]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    target.prefill(prompt)
    best = {n: float("inf") for n in sizes}
    for rep in range(-warmup, reps):  # warm-up passes (allocations, kernel selection, clocks) are not counted
        for n in sizes:
            tree = DraftTree.root(prompt[-1])
            for i in range(1, n):
                tree.add(prompt[i % len(prompt)], (i - 1) // 4, 0.0)  # bushy: 4 children per node
            sync()
            t0 = time.perf_counter()
            target.verify(tree)
            sync()
            if rep >= 0:
                best[n] = min(best[n], time.perf_counter() - t0)
            target.commit([0])
    return best


def _gemm_kind(target) -> str:
    """Which products the verify runs: stock, or rowgemm with this machine's row limits for the target's shapes."""
    if not (_rowgemm_applies(target) and rowgemm.active()):
        return "stock"
    table = rowgemm.limits()
    shapes = sorted({tuple(p.shape) for p in target.model.parameters() if p.dim() == 2})
    return "rowgemm " + ",".join(f"{a}x{b}:{table.get((a, b), rowgemm.MAX_ROWS)}" for a, b in shapes)


def _rowgemm_applies(target) -> bool:
    import torch

    return rowgemm.enabled(target.model) and target.dtype == torch.float32 and target.device.type == "cpu"


def tune_gemm(target, drafter=None) -> dict:
    """Measure rowgemm's per-shape row limits for the target's (and the drafter's head's) float32 linears, once per
    machine (machine.tune_rowgemm); rowgemm.linear then takes W @ X^T only for the shapes and row counts where it
    measured faster. Returns {shape: rows}. Other dtypes and devices run stock and measure nothing."""
    if not _rowgemm_applies(target):
        return {}
    weights = [p for p in target.model.parameters() if p.dim() == 2]  # the linears (and embeddings)
    base = getattr(drafter, "base", drafter)  # WithLookup wraps a HeadDrafter
    weights += base.gemm_weights() if hasattr(base, "gemm_weights") else []
    return tune_rowgemm(weights)


def auto_budget(target, max_budget: int = 256, **kw) -> AdaptiveBudget:
    """The controller engine.generate uses for budget="auto": a measured (or cached) verify-cost prior."""
    return AdaptiveBudget(max_budget=max_budget, cost_prior=measure_cost_prior(target), **kw)


__all__ = ["PRIOR_SIZES", "auto_budget", "measure_cost_prior", "profile_key", "tune_gemm"]
