"""JETFLOW verifies a draft *tree*: each node may attend only to its ancestors. Only attention backends that read the
verify input's `custom_mask` do that. SGLang's defaults with topk=1 (what JETFLOW declares for KV accounting) are
fa3 on Hopper and trtllm_mha on Blackwell, and both run verify as a causal chain without reading the mask, so tree
nodes would attend to their siblings and tokens would silently change.

The guard (a wrapper around SGLang's resolution step `handle_attention_backend_compatibility`, registered by the
plugin) therefore:
  - when the operator chose no backend: declares a safe one and logs it;
  - when the operator chose an unsafe one: refuses at launch with one line naming the safe choices.
Safe: cuda: flashinfer, triton (SGLang's custom-mask verify paths), jetflow_tree_native (this project's SDPA
backend, slow on GPU) and jetflow_tree_triton (this project's Triton tree kernel; not yet run on a GPU inside SGLang,
so never the default there); hip: triton, jetflow_tree_native; cpu and other devices: jetflow_tree_native (stock
torch_native ignores the mask; it is replaced by jetflow_tree_native) and, under TRITON_INTERPRET=1 only,
jetflow_tree_triton.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TREE_NATIVE = "jetflow_tree_native"
TREE_TRITON = "jetflow_tree_triton"
HOOK = "handle_attention_backend_compatibility"
FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


class BackendGuardError(ValueError):
    """An attention backend that cannot verify a tree; one line."""


@dataclass(frozen=True)
class Decision:
    declare: dict  # ServerArgs fields to declare before SGLang picks its defaults
    message: str  # what to log ("" = nothing)


def _device_kind(device: str | None, is_hip: bool) -> str:
    d = (device or "cuda").split(":", 1)[0].lower()
    if d == "cuda" and is_hip:
        return "hip"
    return d


def safe_backends(device: str | None, is_hip: bool = False) -> tuple[str, ...]:
    kind = _device_kind(device, is_hip)
    if kind == "cuda":
        return ("flashinfer", "triton", TREE_NATIVE, TREE_TRITON)
    if kind == "hip":
        return ("triton", TREE_NATIVE)
    return (TREE_NATIVE, TREE_TRITON)


def default_backend(device: str | None, has_flashinfer: bool, is_hip: bool = False) -> str:
    kind = _device_kind(device, is_hip)
    if kind == "cuda":
        return "flashinfer" if has_flashinfer else "triton"
    if kind == "hip":
        return "triton"
    return TREE_NATIVE


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def decide(device: str | None, chosen: dict, has_flashinfer: bool = True, is_hip: bool = False,
           triton_interpret: bool = False) -> Decision:
    """`chosen`: the operator's raw values for FLAGS (None = not given); `triton_interpret`: TRITON_INTERPRET=1 in
    the server's environment (Triton kernels can run on a CPU only then). Raises BackendGuardError."""
    safe = safe_backends(device, is_hip)
    declare, notes = {}, []
    for field in FLAGS:
        value = chosen.get(field)
        if value is None:
            continue
        if value == TREE_TRITON and _device_kind(device, is_hip) not in ("cuda", "hip") and not triton_interpret:
            raise BackendGuardError(f"{_flag(field)} {TREE_TRITON} on {_device_kind(device, is_hip)} runs Triton's "
                                    f"interpreter: start the server with TRITON_INTERPRET=1, or use {TREE_NATIVE}")
        if value == "torch_native" and TREE_NATIVE in safe:
            declare[field] = TREE_NATIVE  # stock torch_native cannot verify at all; ours is it plus the tree mask
            notes.append(f"{_flag(field)} torch_native -> {TREE_NATIVE}")
            continue
        if value not in safe:
            raise BackendGuardError(
                f"JETFLOW cannot verify draft trees with {_flag(field)} {value} on {_device_kind(device, is_hip)}: "
                f"it does not read the tree mask; use {_flag(field)} {' or '.join(safe)}")
    if chosen.get("attention_backend") is None:
        backend = default_backend(device, has_flashinfer, is_hip)
        declare["attention_backend"] = backend
        notes.append(f"no --attention-backend given; using {backend} (it reads the tree mask)")
    return Decision(declare, "JETFLOW attention backend: " + "; ".join(notes) if notes else "")


def check_resolved(device: str | None, prefill: str | None, decode: str | None, is_hip: bool = False) -> None:
    """After SGLang's own step: the backends that will run TARGET_VERIFY must still be safe."""
    safe = safe_backends(device, is_hip)
    for what, value in (("prefill", prefill), ("decode", decode)):
        if value is not None and value not in safe:
            raise BackendGuardError(f"JETFLOW: SGLang resolved the {what} attention backend to {value}, which does "
                                    f"not read the tree mask; pass --attention-backend {' or '.join(safe)}")


def verify_backend(view) -> str | None:
    """The attention backend that runs TARGET_VERIFY: SGLang's hybrid backend takes the decode one when
    speculative_attention_mode is "decode", else the prefill one (its default). The tree mask's layout must follow it."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    prefill, decode = attention_backends_of(view)
    return decode if getattr(view, "speculative_attention_mode", "prefill") == "decode" else prefill


def full_mask(backend: str | None) -> bool:
    """FULL (n x (L+n) per request) for SGLang's custom-mask backends, QLEN_ONLY (n x n) for this project's."""
    return backend not in (TREE_NATIVE, TREE_TRITON)


# -- the SGLang side ---------------------------------------------------------------------------------------------
def _platform_flags() -> tuple[bool, bool]:
    """(has_flashinfer, is_hip) of this machine, False/False when SGLang cannot tell (CPU-only installs)."""
    try:
        from sglang.srt.runtime_context import get_platform

        p = get_platform()
        return bool(getattr(p, "has_flashinfer", False)), bool(getattr(p, "is_hip", False))
    except Exception:  # noqa: BLE001 - platform probing must not break resolution on odd machines
        return False, False


def raw_choices(server_args) -> dict:
    """What the operator passed for FLAGS: SGLang's raw-input snapshot, before any default was declared."""
    raw = getattr(server_args, "_raw_input", None)
    if isinstance(raw, dict):
        return {f: raw.get(f) for f in FLAGS}
    return {f: getattr(server_args, f, None) for f in FLAGS}


def guard_hook(server_args, previous) -> None:
    """Resolution-hook wrapper (see sglang.srt.arg_groups.resolution_hooks)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, declare_resolution, resolving_view

    from jetflow_sglang.sglang.config import is_jetflow

    cfg = resolving_view(server_args)
    if not is_jetflow(cfg.speculative_algorithm):
        return previous(server_args)
    has_flashinfer, is_hip = _platform_flags()
    interpret = os.environ.get("TRITON_INTERPRET", "") == "1"
    decision = decide(cfg.device, raw_choices(server_args), has_flashinfer, is_hip, interpret)
    if decision.declare:
        declare_resolution(server_args, "jetflow.backend_guard", **decision.declare)
    if decision.message:
        logger.info(decision.message)
    previous(server_args)
    check_resolved(cfg.device, *attention_backends_of(resolving_view(server_args)), is_hip=is_hip)

