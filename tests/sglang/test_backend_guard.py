"""The attention-backend guard: JETFLOW verifies only through backends that read the tree mask. The decision is
unit-tested without a GPU, including SGLang's own SM80/SM90/SM100 defaults (flashinfer/fa3/trtllm_mha)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from jetflow_sglang.sglang.attention.guard import (TREE_NATIVE, BackendGuardError, check_resolved, decide,
                                                 default_backend, safe_backends)

NONE = {"attention_backend": None, "prefill_attention_backend": None, "decode_attention_backend": None}


def chosen(**kw):
    return {**NONE, **kw}


@pytest.mark.parametrize("device,has_fi,hip,want", [
    ("cuda", True, False, "flashinfer"), ("cuda:1", False, False, "triton"), ("cuda", True, True, "triton"),
    ("cpu", False, False, TREE_NATIVE), ("xpu", False, False, TREE_NATIVE), (None, True, False, "flashinfer"),
])
def test_default_when_nothing_chosen_is_safe_and_logged(device, has_fi, hip, want):
    d = decide(device, chosen(), has_flashinfer=has_fi, is_hip=hip)
    assert d.declare == {"attention_backend": want}
    assert want in safe_backends(device, hip) and want == default_backend(device, has_fi, hip)
    assert f"using {want}" in d.message


@pytest.mark.parametrize("device,field,value", [
    ("cuda", "attention_backend", "fa3"), ("cuda", "attention_backend", "trtllm_mha"),
    ("cuda", "attention_backend", "fa4"), ("cuda", "attention_backend", "flex_attention"),
    ("cuda", "attention_backend", "torch_native_unknown"), ("cuda", "prefill_attention_backend", "fa3"),
    ("cuda", "decode_attention_backend", "trtllm_mha"), ("cpu", "attention_backend", "intel_amx"),
    ("cpu", "attention_backend", "triton"),
])
def test_explicit_unsafe_choice_is_refused_in_one_line(device, field, value):
    with pytest.raises(BackendGuardError) as e:
        decide(device, chosen(**{field: value}))
    msg = str(e.value)
    assert "\n" not in msg and value in msg and "--" + field.replace("_", "-") in msg
    for safe in safe_backends(device):
        assert safe in msg


@pytest.mark.parametrize("device,value", [("cuda", "flashinfer"), ("cuda", "triton"), ("cuda", TREE_NATIVE),
                                          ("cpu", TREE_NATIVE)])
def test_explicit_safe_choice_is_kept(device, value):
    d = decide(device, chosen(attention_backend=value))
    assert d.declare == {} and d.message == ""


def test_torch_native_is_replaced_by_the_tree_backend():
    d = decide("cpu", chosen(attention_backend="torch_native"))
    assert d.declare == {"attention_backend": TREE_NATIVE} and "torch_native" in d.message
    d = decide("cpu", chosen(decode_attention_backend="torch_native"))
    assert d.declare == {"decode_attention_backend": TREE_NATIVE, "attention_backend": TREE_NATIVE}


def test_split_choice_keeps_safe_base_default():
    d = decide("cuda", chosen(decode_attention_backend="triton"), has_flashinfer=True)
    assert d.declare == {"attention_backend": "flashinfer"}


def test_check_resolved():
    check_resolved("cuda", "flashinfer", "triton")
    with pytest.raises(BackendGuardError, match="prefill attention backend to fa3"):
        check_resolved("cuda", "fa3", "flashinfer")


# -- against SGLang's own ServerArgs and default selection (no GPU: the platform is faked) -----------------------
sglang = pytest.importorskip("sglang") if os.environ.get("JETFLOW_SKIP_SGLANG") != "1" else None
SM = {  # what SGLang's get_default_attn_backend reads from the platform
    "SM80": dict(is_hopper_with_cuda_12_3=False, is_sm100=False, has_flashinfer=True, sglang_default="flashinfer"),
    "SM90": dict(is_hopper_with_cuda_12_3=True, is_sm100=False, has_flashinfer=True, sglang_default="fa3"),
    "SM100": dict(is_hopper_with_cuda_12_3=False, is_sm100=True, has_flashinfer=True, sglang_default="trtllm_mha"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.sglang.sgl_fixtures import build_tiny_qwen3

    return str(build_tiny_qwen3(tmp_path_factory.mktemp("bg") / "tiny-qwen3"))


def _fake_platform(monkeypatch, sm):
    from sglang.srt.arg_groups import model_override_base
    from jetflow_sglang.sglang.attention import guard as backend_guard

    flags = {k: v for k, v in SM[sm].items() if k != "sglang_default"}
    plat = SimpleNamespace(is_hip=False, **flags)
    monkeypatch.setattr(model_override_base, "get_platform", lambda: plat)
    monkeypatch.setattr(backend_guard, "_platform_flags", lambda: (plat.has_flashinfer, False))


def _record(model, **kw):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=model, device="cuda", speculative_algorithm="JETFLOW", **kw)


def _sglang_default_step(sa):
    """SGLang's own default-fill pass of handle_attention_backend_compatibility (the part the guard wraps)."""
    from sglang.srt.arg_groups.overrides import _attention_backend_default, run_post_process_pass

    run_post_process_pass(sa, _attention_backend_default)


@pytest.mark.parametrize("sm", list(SM))
def test_sglang_defaults_per_sm_and_the_guard(sm, tiny_model, monkeypatch):
    from jetflow_sglang.sglang.cpu import ops as cpu_ops

    cpu_ops.install()  # as in every CPU SGLang process: SGLang's arg resolution imports torchvision and sgl_kernel
    from sglang.srt.arg_groups.overrides import resolving_view

    from jetflow_sglang.sglang.attention.guard import guard_hook

    _fake_platform(monkeypatch, sm)
    # SGLang alone (topk=1, what JETFLOW declares) picks fa3 on SM90 and trtllm_mha on SM100: unsafe for trees
    plain = _record(tiny_model, speculative_eagle_topk=1)
    _sglang_default_step(plain)
    assert resolving_view(plain).attention_backend == SM[sm]["sglang_default"]
    # with the guard in front, the operator's silence becomes flashinfer, on every SM
    sa = _record(tiny_model, speculative_eagle_topk=1)
    guard_hook(sa, _sglang_default_step)
    assert resolving_view(sa).attention_backend == "flashinfer"
    # an explicit unsafe choice is refused, a safe one kept
    with pytest.raises(BackendGuardError, match="fa3"):
        guard_hook(_record(tiny_model, attention_backend="fa3"), _sglang_default_step)
    kept = _record(tiny_model, attention_backend="triton")
    guard_hook(kept, _sglang_default_step)
    assert resolving_view(kept).attention_backend == "triton"
