"""JETFLOW on a CPU server with `--page-size` > 1.

SGLang's speculative KV reservation (`alloc_for_spec_decode`) finds each request's last KV slot through
`allocation.get_last_loc`, which takes a Triton kernel unless the attention backend is `torch_native` or `ascend`.
JETFLOW's CPU backends (`jetflow_tree_native`, `jetflow_tree_triton`) are neither, and a CPU has no Triton driver,
so a paged JETFLOW server died at its first decode ("0 active drivers") where the plain server runs. `install()` sends
CPU tensors to SGLang's own torch version of that lookup; device tensors keep SGLang's dispatch. Listed in
compat.PATCHES; the worker installs it for a CPU target only.
"""
from __future__ import annotations

from jetflow_sglang.sglang.compat import wrap


def install() -> None:
    from sglang.srt.mem_cache import allocation

    def make(original):
        def get_last_loc(req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
            if req_to_token.device.type == "cpu":
                return allocation.get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
            return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
        return get_last_loc

    wrap(allocation, "get_last_loc", make)
