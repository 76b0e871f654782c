"""The pure-torch sgl_kernel ops (JETFLOW_SGLANG_CPU=1) against their documented semantics, and the tree packing."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from jetflow_sglang.sglang.cpu import ops as cpu_ops

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
    code = ("import jetflow_sglang.sglang.cpu.ops as c; c.install(); import os, sgl_kernel\n"
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


def _random_tree_masks(b: int, n: int, seed: int):
    """[b, n, n] ancestor-or-self masks of random trees (node i's parent is a random earlier node), and the parents."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, n, n, dtype=torch.bool)
    parents = torch.full((b, n), -1, dtype=torch.long)
    for r in range(b):
        for i in range(n):
            mask[r, i, i] = True
            if i:
                p = int(torch.randint(0, i, (1,), generator=g))
                parents[r, i] = p
                mask[r, i] |= mask[r, p]
    return mask, parents


def test_reconstruct_indices_from_tree_mask_matches_the_host_reference():
    """The NGRAM metadata op against SGLang's own host derivation of the links (ngram_worker._derive_tree_links)
    and the stated positions / retrieve_index contract, on random trees."""
    import numpy as np
    import pytest

    pytest.importorskip("sglang")
    cpu_ops.install()
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask as op
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    assert op is cpu_ops.reconstruct_indices_from_tree_mask
    for seed, (b, n) in enumerate([(1, 1), (3, 8), (4, 16), (2, 5)]):
        mask, parents = _random_tree_masks(b, n, seed)
        seq = torch.tensor([7, 30, 0, 12][:b])
        pos, ridx, nxt, sib = (torch.full((b, n), -9, dtype=torch.long) for _ in range(4))
        op(mask.flatten(), seq, pos.view(-1), ridx, nxt, sib, b, n)
        ref_next, ref_sib = _derive_tree_links(mask.numpy().reshape(-1), b, n)
        assert torch.equal(nxt, torch.as_tensor(np.asarray(ref_next)).view(b, n).long()), seed
        assert torch.equal(sib, torch.as_tensor(np.asarray(ref_sib)).view(b, n).long()), seed
        depth = mask.sum(-1) - 1
        assert torch.equal(pos, seq[:, None] + depth) and torch.equal(ridx.view(-1), torch.arange(b * n))
        kids = [[[k for k in range(n) if parents[r, k] == i] for i in range(n)] for r in range(b)]
        assert all(nxt[r, i] == (kids[r][i][0] if kids[r][i] else -1) for r in range(b) for i in range(n))


def test_verify_tree_greedy_cpu_walks_first_matching_child():
    """Root 0 -> children 1 (tok 5), 2 (tok 6); 2 -> 3 (tok 7), 4 (tok 8). The target predicts 6 after the root,
    8 after node 2, then 9: nodes 2 and 4 are accepted (siblings are searched in order), 9 is the bonus."""
    cpu_ops.install()
    cand = torch.tensor([[4, 5, 6, 7, 8]])
    tp = torch.tensor([[6, 0, 8, 0, 9]])  # target's argmax at every node
    nxt = torch.tensor([[1, -1, 3, -1, -1]])
    sib = torch.tensor([[-1, 2, -1, 4, -1]])
    ridx = torch.arange(5)[None]
    predicts = torch.full((5,), -1)
    accept_index = torch.full((1, 4), -1)
    accept_num = torch.zeros(1, dtype=torch.long)
    cpu_ops.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                                   candidates=cand, retrive_index=ridx, retrive_next_token=nxt,
                                   retrive_next_sibling=sib, target_predict=tp)
    assert accept_index.tolist() == [[0, 2, 4, -1]] and accept_num.tolist() == [2]
    assert predicts[0] == 6 and predicts[2] == 8 and predicts[4] == 9  # the accepted tokens, then the bonus
