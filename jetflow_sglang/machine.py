"""The machine a measurement was taken on: what benchmarks record and what measured choices are cached by."""
from __future__ import annotations

import platform

from jetflow_sglang.core import rowgemm
from jetflow_sglang.paths import cache_dir


def cpu_model() -> str:
    """The CPU's model name (one name can cover CPUs with different vector units: see isa())."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _flags() -> set[str]:
    try:
        return set(next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def bf16_isa() -> str:
    """The CPU's native bfloat16 support ('AMX', 'AVX512-BF16' or 'no bf16'): it decides the dtype and verify cost."""
    flags = _flags()
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "no bf16"


def cpu_kind() -> str:
    """Model name and widest vector unit ('AMD EPYC (AVX512-BF16)'): what a measured kernel choice holds for."""
    flags = _flags()
    vec = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    isa = bf16_isa()
    return f"{cpu_model()} ({isa if isa != 'no bf16' else vec})"


def tune_rowgemm(weights) -> dict:
    """rowgemm.tune for these weights on this machine, cached in the user cache (the engine and the server call it)."""
    return rowgemm.tune(weights, cache_file=cache_dir() / "gemm_limits.json", machine=cpu_kind())
