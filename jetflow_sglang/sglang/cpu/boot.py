"""Imported from `jetflow_sglang_cpu.pth` (written by scripts/install_sglang_cpu.sh) at interpreter start when
JETFLOW_SGLANG_CPU=1: SGLang spawns its scheduler and detokenizer processes, and they import `sgl_kernel` at
module level, before any plugin hook runs, so the CPU shim has to be in place that early."""
from jetflow_sglang.sglang.cpu.ops import enabled, install

if enabled():
    install()
