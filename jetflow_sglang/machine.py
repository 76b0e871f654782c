"""The machine a measurement was taken on: what benchmarks record and what measured choices are cached by."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
