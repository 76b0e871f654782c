"""The pure-torch sgl_kernel ops (JETFLOW_SGLANG_CPU=1) against their documented semantics, and the tree packing."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from jetflow_sglang.sglang import cpu_ops

torch.set_num_threads(1)


def test_assign_extend_and_req_to_token_roundtrip():
    r2t = torch.zeros(3, 16, dtype=torch.int32)
    rpi, start, end = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)
    cpu_ops.assign_req_to_token_pool_cpu(rpi, r2t, start, end, locs, 16)
    assert r2t[2, 3:6].tolist() == [10, 11, 12] and r2t[0, 0:2].tolist() == [20, 21]
    out = torch.empty(5, dtype=torch.int64)
    cpu_ops.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out, 16)
    assert out.tolist() == locs.tolist()


def test_fill_accept_out_cache_loc_compacts_in_row_order():
    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.tensor([100, 101, 102, 103, 104, 105])
    out = torch.zeros(6, dtype=torch.int64)
    cpu_ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, out)
    assert out[:3].tolist() == [100, 102, 103]


def test_fill_bonus_tokens():
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    bonus = torch.zeros(2, dtype=torch.int64)
    cpu_ops.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [6, 10]


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer():
    bufs = [torch.arange(8 * 6, dtype=torch.float32).view(8, 6).clone() for _ in range(2)]
    bufs.append(torch.arange(8 * 4, dtype=torch.float16).view(8, 4).clone())
    ref = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([1, 2]), torch.tensor([5, 1])  # overlapping: row 1 is read before it is written
    cpu_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        assert torch.equal(b[1], r[5]) and torch.equal(b[2], r[1])
        assert torch.equal(b[[0, 3, 4, 5, 6, 7]], r[[0, 3, 4, 5, 6, 7]])


def test_shim_serves_stub_modules_in_a_fresh_process():
    code = ("import jetflow_sglang.sglang.cpu_ops as c; c.install(); import os, sgl_kernel\n"
            "from sgl_kernel import copy_all_layer_kv_cache_cpu as f; assert f is c.copy_all_layer_kv_cache_cpu\n"
            "import sgl_kernel.flash_attn as fa\n"
            "try:\n    sgl_kernel.some_cuda_op(1)\nexcept NotImplementedError as e:\n    print('raised', e)\n"
            "print(os.environ['SGLANG_USE_CPU_ENGINE'])")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised" in out.stdout and "sgl_kernel.some_cuda_op" in out.stdout and out.stdout.strip().endswith("1")


def test_enabled_switch(monkeypatch):
    for v, want in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv(cpu_ops.ENV, v)
        assert cpu_ops.enabled() is want
