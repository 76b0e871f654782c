"""Ahead-of-time compilation of the Triton tree kernel for a GPU target on a machine without one: the PTX, registers
and spill bytes of each shipped configuration (bundled ptxas -v). Used by scripts/gpu_check_kernels.py and a CPU test;
no serving or engine path calls it. Import without TRITON_INTERPRET=1 (it needs the real JIT)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton

from jetflow_sglang.kernels.triton_tree_attn import Config, _tree_attn_fwd, pick_config

_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def aot_compile(head_dim: int, dtype: torch.dtype, arch: int = 90, causal: bool = False, config: Config | None = None,
                group: int = 4, num_splits: int = 1) -> dict:
    """Compile one configuration for sm_<arch> without a GPU; returns ptx, regs and spill bytes (bundled ptxas -v)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(_tree_attn_fwd, triton.runtime.jit.JITFunction):
        raise RuntimeError("AOT compile needs the real JIT: import this module without TRITON_INTERPRET=1")
    cfg = config or pick_config(head_dim, dtype)
    ty = _TL_DTYPE[dtype]
    names = _tree_attn_fwd.arg_names
    sig = {}
    for name in names:
        if name in ("Q", "K", "V", "O"):
            sig[name] = f"*{ty}"
        elif name in ("Part", "ML"):  # split-KV partial results, always fp32
            sig[name] = "*fp32"
        elif name in ("BlockTable", "PrefixLens", "QoIndptr", "MaskWords"):
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        elif name.isupper() or name.startswith("BLOCK"):
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, IEEE=dtype == torch.float32,
                  NUM_SPLITS=num_splits)
    # Alignment a real launch gets specialised on: 16-byte aligned pointers, head/token strides multiples of 16.
    aligned = ["Q", "K", "V", "O", "Part", "ML", "BlockTable", "PrefixLens", "QoIndptr", "MaskWords", "stride_qt", "stride_qh",
               "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs", "stride_vh", "stride_ot", "stride_oh"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(_tree_attn_fwd, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = kernel.asm["ptx"]
    info = dict(head_dim=head_dim, dtype=ty, arch=arch, causal=causal, num_splits=num_splits, config=cfg.__dict__,
                ptx_chars=len(ptx),
                wgmma="wgmma" in ptx, mma_sync="mma.sync" in ptx, shared=kernel.metadata.shared)
    info.update(ptxas_usage(ptx, f"sm_{arch}a" if arch == 90 else f"sm_{arch}"))
    return info


def ptxas_usage(ptx: str, arch: str) -> dict:
    """Registers and spill bytes reported by the ptxas bundled with Triton."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise FileNotFoundError(f"no ptxas bundled with triton at {ptxas}")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {res.stderr[-2000:]}")
    log = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if not (regs and stores and loads):
        raise RuntimeError(f"cannot parse ptxas -v output: {log[-2000:]}")
    return dict(registers=int(regs.group(1)), spill_stores=int(stores.group(1)), spill_loads=int(loads.group(1)))
