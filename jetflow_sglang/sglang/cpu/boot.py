"""Imported from `jetflow_sglang_cpu.pth` (written by scripts/install_sglang_cpu.sh) at interpreter start when
JETFLOW_SGLANG_CPU=1: SGLang spawns its scheduler and detokenizer processes, and they import `sgl_kernel` at
module level, before any plugin hook runs, so the CPU shim has to be in place that early.

With JETFLOW_BENCH_DFLASH_PEER=1 as well (set only by the benchmark and its tests for their DFLASH servers), SGLang's
own DFLASH is made to run on the CPU (dflash_peer.py)."""
import os
import sys

from jetflow_sglang.sglang.cpu.ops import enabled, install

if enabled():
    install()
    from jetflow_sglang.sglang.cpu import dflash_peer

    try:
        peer = dflash_peer.setting().on
    except dflash_peer.PeerSettingError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)  # SystemExit inside site start-up would print a fatal-error dump instead of one line
    if peer:
        dflash_peer.install()
