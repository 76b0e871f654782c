"""A JETFLOW launch on a GPU, resolved by SGLang's own `ServerArgs.resolve_once()` on a faked platform (no GPU here):
SM80, SM90 and SM100; SGLang's default backend choice, flashinfer, triton and jetflow_tree_triton; mixed prefill and
decode backends; the overlap scheduler on and off; --tp 2. Each case asserts what the worker will meet:
- CUDA graphs off for both phases in `cuda_graph_config`, the record the runtime reads (the legacy boolean alone,
  which SGLang parsed before the plugin's step, left the decode graph on: it would have captured TARGET_VERIFY with
  no tree mask);
- the backend that runs verify (the prefill one, SGLang's default speculative_attention_mode) reads the tree mask;
- the worker's mask layout is that backend's (FULL for SGLang's custom-mask backends, QLEN_ONLY for ours);
- the page size and the scheduler mode."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)

from tests.sglang.test_backend_guard import SM  # noqa: E402

CASES = {  # name: (extra ServerArgs fields, the backend that must run verify, FULL mask)
    "default": ({}, "flashinfer", True),
    "flashinfer": ({"attention_backend": "flashinfer"}, "flashinfer", True),
    "triton": ({"attention_backend": "triton"}, "triton", True),
    "tree-triton": ({"attention_backend": "jetflow_tree_triton"}, "jetflow_tree_triton", False),
    "mixed": ({"attention_backend": "flashinfer", "decode_attention_backend": "jetflow_tree_triton"}, "flashinfer",
              True),
    "mixed-ours-verify": ({"prefill_attention_backend": "jetflow_tree_triton", "decode_attention_backend": "triton"},
                          "jetflow_tree_triton", False),
    "paged-sync": ({"attention_backend": "triton", "page_size": 16, "disable_overlap_schedule": True}, "triton",
                   True),
    "tp2": ({"tp_size": 2}, "flashinfer", True),
}


@pytest.fixture(scope="module")
def models():
    from tests.sglang.sgl_fixtures import shared_head, shared_tiny

    target = shared_tiny()
    return str(target), str(shared_head(target))


def _fake_gpu(monkeypatch, sm: str) -> None:
    import torch
    from sglang.srt.arg_groups import model_override_base

    from jetflow_sglang.sglang.attention import guard as backend_guard

    flags = {k: v for k, v in SM[sm].items() if k != "sglang_default"}
    plat = SimpleNamespace(is_hip=False, **flags)
    monkeypatch.setattr(model_override_base, "get_platform", lambda: plat)
    monkeypatch.setattr(backend_guard, "_platform_flags", lambda: (plat.has_flashinfer, False))
    major = {"SM80": 8, "SM90": 9, "SM100": 10}[sm]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (major, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sm", list(SM))
def test_a_gpu_launch_resolves_to_what_the_worker_supports(sm, case, models, monkeypatch):
    from jetflow_sglang.sglang.cpu import ops as cpu_ops

    cpu_ops.install()  # SGLang's arg resolution imports sgl_kernel and torchvision, as in every CPU SGLang process
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from jetflow_sglang.sglang.attention.guard import full_mask, verify_backend
    from jetflow_sglang.sglang.config import DEFAULT_BUDGET

    load_plugins()
    _fake_gpu(monkeypatch, sm)
    extra, want_backend, want_full = CASES[case]
    target, head = models
    sa = ServerArgs(model_path=target, device="cuda", speculative_algorithm="JETFLOW",
                    speculative_draft_model_path=head, **extra)
    sa.resolve_once()
    view = resolving_view(sa)
    graphs = view.cuda_graph_config
    assert graphs.decode.backend == Backend.DISABLED and graphs.prefill.backend == Backend.DISABLED, graphs
    assert view.disable_cuda_graph is True
    assert verify_backend(view) == want_backend, attention_backends_of(view)
    assert full_mask(verify_backend(view)) is want_full
    assert view.page_size == extra.get("page_size", 1)
    assert view.disable_overlap_schedule is bool(extra.get("disable_overlap_schedule", False))  # overlap off the CPU
    assert view.speculative_num_draft_tokens == DEFAULT_BUDGET["accelerator"] and view.speculative_eagle_topk == 1
    if "tp_size" in extra:
        assert view.tp_size == 2
