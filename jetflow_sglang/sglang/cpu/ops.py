"""Run SGLang 0.5.23 on a CPU without its CPU kernel build: switch on with JETFLOW_SGLANG_CPU=1.

SGLang's CPU engine imports `sgl_kernel` (an AVX-512/AMX C++ build that is not published as a wheel; the
PyPI `sglang-kernel` is CUDA-only) at module level, and its lite install has no loadable `torchvision`.
`install()` serves both as import stubs and gives the few `sgl_kernel` ops that plain and JETFLOW decoding
call real pure-torch implementations. Any other op raises NotImplementedError naming itself, so an
unsupported path fails loudly instead of computing garbage. SGLang detects AMX through
`torch.ops.sgl_kernel.convert_weight_packed`, which is never registered here, so layers keep their
`forward_native` paths.
"""
from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

ENV = "JETFLOW_SGLANG_CPU"


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------------------
# pure-torch versions of the sgl_kernel CPU ops (same argument order as the C++ ops; outputs written in place)
# ---------------------------------------------------------------------------------------------------------
def _rows(req_to_token, req_pool_indices, start, end, size: int):
    """Concatenation over requests i of req_to_token[req_pool_indices[i], start[i]:end[i]], as `size` entries
    (past the total: 0), computed on the device without reading the lengths on the host."""
    lens = (end - start).long()
    cum = torch.cumsum(lens, 0)
    pos = torch.arange(size, device=lens.device)
    req = torch.searchsorted(cum, pos, right=True)
    live = req < lens.numel()
    req = req.clamp(max=max(lens.numel() - 1, 0))
    col = start.long()[req] + pos - (cum - lens)[req]
    vals = req_to_token[req_pool_indices.long()[req], col.clamp(0, req_to_token.shape[1] - 1)]
    return torch.where(live, vals, torch.zeros_like(vals))


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    out_cache_loc.copy_(_rows(req_to_token, req_pool_indices, start_offset, end_offset, out_cache_loc.numel()))


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        req_to_token[int(r), int(s):int(e)] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk, num_steps,
                                           *_):
    n = topk * num_steps
    out_cache_loc.copy_(_rows(req_to_token, req_pool_indices, seq_lens, seq_lens + n, out_cache_loc.numel()))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact: the k-th non-negative entry of accept_index (row-major) picks out_cache_loc into slot k; later slots
    keep their values. A scatter (the others go to a spare slot), not a boolean index: no host wait, as on a GPU."""
    flat = accept_index.reshape(-1)
    keep = flat >= 0
    n = accept_out_cache_loc.numel()
    dest = torch.where(keep, keep.long().cumsum(0) - 1, torch.full_like(flat, n, dtype=torch.long))
    vals = out_cache_loc[flat.clamp(min=0).long()].to(accept_out_cache_loc.dtype)
    out = torch.cat([accept_out_cache_loc, accept_out_cache_loc.new_zeros(1)]).scatter_(0, dest, vals)
    accept_out_cache_loc.copy_(out[:n])


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    bs = accept_lens.numel()
    idx = torch.arange(bs, device=accept_lens.device) * accept_stride + accept_lens.long() - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


_VIEWS: dict = {}  # id of the pool's pointer tensor -> (that tensor, its buffers as uint8 [rows, stride] views)
POOL_ROWS: dict = {"rows": None}  # rows of every KV buffer, set by the JETFLOW worker at pool allocation


def _buffer_views(data_ptrs, strides, rows: int):
    """The KV buffers behind SGLang's raw pointers, built once per pool (the pointers never change)."""
    hit = _VIEWS.get(id(data_ptrs))
    if hit is None or hit[0] is not data_ptrs or hit[1][0].shape[0] < rows:
        views = []
        for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
            buf = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
            views.append(torch.frombuffer(buf, dtype=torch.uint8).view(rows, int(stride)))
        hit = _VIEWS[id(data_ptrs)] = (data_ptrs, views)
    return hit[1]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Copy KV rows src_loc -> tgt_loc in every buffer. The pool passes raw data pointers and row strides
    (bytes), so each buffer is viewed as uint8 [rows, stride] straight from its pointer (once per pool, when the
    worker has told the row count). Gather before scatter, so overlapping src/tgt sets behave like a move."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = POOL_ROWS["rows"] or int(max(tgt.max(), src.max())) + 1
    for view in _buffer_views(data_ptrs, strides, rows):
        view[tgt] = view[src]


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index, retrieve_next_token,
                                       retrieve_next_sibling, batch_size, draft_token_num):
    """SGLang's NGRAM verify metadata from its [b, n, n] ancestor-or-self mask (the contract stated in
    sglang/kernels/ops/speculative/reconstruct_tree.py): positions = seq_len + depth, retrieve_index = b * n + i,
    first child and next sibling of every node (-1 when none). Lets SGLang's own NGRAM run on CPU for comparison."""
    b, n = int(batch_size), int(draft_token_num)
    if b == 0:
        return
    dev = tree_mask.device
    idx = torch.arange(n, device=dev)
    anc = tree_mask.reshape(-1)[: b * n * n].view(b, n, n).bool() & (idx[None, :] < idx[:, None])  # strict
    parent = torch.where(anc, idx, -1).amax(-1)  # [b, n]: the nearest (largest) strict ancestor
    first_child = torch.where(anc, idx[:, None], n).amin(1)  # [b, n]: smallest k with ancestors[k, tid]
    later = idx[:, None] > idx[None, :]  # [k, tid]: k > tid
    same = (parent[:, :, None] == parent[:, None, :]) & later
    first_sib = torch.where(same, idx[:, None], n).amin(1)
    flat = lambda t, x: t.view(-1)[: b * n].copy_(x.reshape(-1).to(t.dtype))  # noqa: E731
    flat(positions, anc.sum(-1) + verified_seq_len[:b, None].to(dev))
    flat(retrieve_index, torch.arange(b * n, device=dev))
    flat(retrieve_next_token, torch.where(first_child < n, first_child, -1))
    flat(retrieve_next_sibling, torch.where((parent >= 0) & (first_sib < n), first_sib, -1))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict):
    """SGLang's greedy tree verify (the contract of its Triton kernel in kernels/ops/speculative/spec_tree.py): walk
    from the root, at each level take the first child (then its siblings) whose token is the target's prediction at
    the last accepted node. NGRAM's path only (JETFLOW accepts on the device in accept.py); batch x depth loop."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.reshape(-1)
    for b in range(bs):
        last, num, cur = ridx[b][0], 0, 0
        accepted = [last]
        for _ in range(1, steps):
            cur = nxt[b][cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = sib[b][cur]
            if cur == -1:
                break
            pred[last] = target[last]
            num += 1
            last = ridx[b][cur]
            accepted.append(last)
        accept_index[b, :len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = num
        pred[last] = target[last]


OPS = {f.__name__: f for f in (
    assign_extend_cache_locs_cpu, assign_req_to_token_pool_cpu, assign_draft_cache_locs_contiguous_cpu,
    fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, copy_all_layer_kv_cache_cpu, verify_tree_greedy_cpu)}
SUBMODULE_OPS = {"sgl_kernel.speculative": {"reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask}}


# ---------------------------------------------------------------------------------------------------------
# import stubs
# ---------------------------------------------------------------------------------------------------------
class _StubMeta(type):
    """Any attribute of a stub is another stub class; calling one raises. Classes, so code may subclass them."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__qualname__}.{name}")

    def __call__(cls, *a, **k):
        raise NotImplementedError(f"{cls.__qualname__} is not available: JETFLOW_SGLANG_CPU=1 stubs it on CPU "
                                  "(jetflow_sglang.sglang.cpu.ops)")


def _stub(qualname: str) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "jetflow_stub"})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__ == "sgl_kernel" and name in OPS:
            return OPS[name]
        if name in SUBMODULE_OPS.get(self.__name__, {}):
            return SUBMODULE_OPS[self.__name__][name]
        return _stub(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []  # a package, so any submodule import also lands here
        mod.__version__ = "0.0.0+jetflow.cpu.stub"
        return mod

    def exec_module(self, module):
        pass


def _importable(name: str) -> bool:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    try:  # torchvision from PyPI fails to load beside a CPU torch ("operator torchvision::nms does not exist")
        __import__(name)
        return True
    except Exception:
        sys.modules.pop(name, None)
        return False


_installed = False


def install() -> None:
    """Make SGLang's CPU engine importable and runnable here. Idempotent; call before SGLang is imported."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # sglang.srt.utils.is_cpu() reads it
    # sgl_kernel: always ours (the PyPI build is CUDA-only and fails on import without libcuda).
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder(["sgl_kernel"]))
    # torchvision: only when no working one is installed (it is imported at module level by SGLang's configs).
    if "torchvision" not in sys.modules and not _importable("torchvision"):
        sys.meta_path.append(_StubFinder(["torchvision"]))
