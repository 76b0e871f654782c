"""SGLang's own DFLASH on a CPU, as a benchmark peer of JETFLOW (scripts/bench_serving.py, tests only).

SGLang 0.5.23's DFLASH does not start on a CPU (../../../docs/SGLANG_RECORD.md, "SGLang's DFLASH as a benchmark peer").
This module makes it run there, and is active only in a server process whose launch environment has

    JETFLOW_BENCH_DFLASH_PEER=1      (together with JETFLOW_SGLANG_CPU=1, which loads cpu/boot.py at start-up)

which the benchmark and tests/sglang/test_dflash_peer.py set for their DFLASH servers alone. The setting is read
once (`setting()`); nothing here writes os.environ. What it changes, each listed in compat.PATCHES:

  - `_handle_dflash`: on --device cpu, SGLang's checks run against a platform view that accepts DFLASH and offers
    only `dflash_peer_native` as the draft attention backend (the stock gate accepts cuda, npu and xpu alone).
  - `dflash_peer_native`, a draft attention backend registered through SGLang's public registries
    (register_attention_backend, add_draft_attention_backend_choices): SGLang runs the draft block as a
    TARGET_VERIFY forward, which stock torch_native cannot (extend_prefix_lens is None). Its rows attend to the
    committed context and to the block: bidirectionally for ENCODER_ONLY layers (DFlash's default), causally for
    DECODER layers. `jetflow_tree_native` treats every TARGET_VERIFY without a custom mask as causal, which would
    give silently wrong drafts, so it is never the DFLASH draft backend here.
  - `ModelRunner._extend_forward_kwargs`: the draft's input embeddings keep the model's dtype (SGLang casts them to
    bfloat16 unconditionally, which breaks a float32 server).
  - `torch.Tensor.record_stream`: a no-op for CPU tensors (DFLASH records the batch's seq_lens on the current
    stream; CPU tensors have no streams and torch raises "unknown parameter type").
  - `DFlashAttention.__init__`: the draft layers take SGLang's torch q/k-norm + RoPE path instead of its fused
    Triton kernel, which a bfloat16 draft uses and which has no CPU driver ("0 active drivers").
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

ENV = "JETFLOW_BENCH_DFLASH_PEER"
BACKEND = "dflash_peer_native"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
EXTEND_KWARGS = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"
RECORD_STREAM = "torch.Tensor.record_stream"
DRAFT_ATTENTION_INIT = "sglang.srt.models.dflash.DFlashAttention.__init__"


class PeerSettingError(ValueError):
    """A bad JETFLOW_BENCH_DFLASH_PEER value (one line)."""


@dataclass(frozen=True)
class PeerSetting:
    on: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PeerSetting":
        value = env.get(ENV, "").strip().lower()
        if value in _ON:
            return cls(True)
        if value in _OFF:
            return cls(False)
        raise PeerSettingError(f"{ENV} must be 1 or 0; got {env.get(ENV)!r}")


@functools.lru_cache(maxsize=1)
def setting() -> PeerSetting:
    """The process's setting, read once from its launch environment."""
    return PeerSetting.from_env(os.environ)


_installed = False


def install() -> None:
    """Register the hooks (applied by SGLang's load_plugins in every server process), the draft backend and the
    record_stream shim. Idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.arg_groups.choices import (ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES,
                                               add_attention_backend_choices, add_draft_attention_backend_choices)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(_create_backend)
    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    if BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([BACKEND])
    source = HookSource(plugin_name="jetflow_dflash_peer", dist_name="jetflow-sglang")
    HookRegistry.register(HANDLE_DFLASH, _handle_dflash_hook, HookType.AROUND, source=source)
    HookRegistry.register(EXTEND_KWARGS, _extend_kwargs_hook, HookType.AROUND, source=source)
    HookRegistry.register(DRAFT_ATTENTION_INIT, _draft_attention_init_hook, HookType.AROUND, source=source)
    _patch_record_stream()
    _installed = True


# -- 1. the device gate and the draft backend choice ------------------------------------------------------------
class CpuDflashPeerPlatform:
    """SGLang's platform as `_handle_dflash` sees it on a CPU: DFLASH supported, `dflash_peer_native` the one draft
    attention backend (any other request falls back to it, with SGLang's own warning). Everything else is the real
    platform's."""

    def __init__(self, base):
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return BACKEND


def _handle_dflash_hook(original, server_args):
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.overrides import resolving_view

    if str(resolving_view(server_args).device or "").lower() != "cpu":
        return original(server_args)
    real = speculative_hook.current_platform
    speculative_hook.current_platform = CpuDflashPeerPlatform(real)
    try:
        return original(server_args)
    finally:
        speculative_hook.current_platform = real


# -- 2. the draft attention backend ------------------------------------------------------------------------------
def _create_backend(runner):
    return _backend_class()(runner)


@functools.lru_cache(maxsize=1)
def _backend_class():
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class DFlashPeerAttnBackend(TorchNativeAttnBackend):
        """torch_native plus DFLASH's draft block: in TARGET_VERIFY the n block rows of each request attend to its
        committed context (forward_batch.seq_lens) and to the block itself: all of it for ENCODER_ONLY layers,
        up to and including themselves for DECODER layers."""

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not forward_batch.forward_mode.is_target_verify():
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            if getattr(layer, "sliding_window_size", -1) not in (None, -1):
                raise NotImplementedError(f"{BACKEND}: sliding-window draft layers are not supported")
            n = int(forward_batch.spec_info.draft_token_num)
            if save_kv_cache and k is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            lens = forward_batch.seq_lens.long()  # committed context; the block's n rows follow it
            b = lens.shape[0]
            width = int(lens.max()) + n
            rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), :width].long()
            cols = torch.arange(width, device=lens.device)[None, None]
            start = lens[:, None, None]
            in_block = (cols >= start) & (cols < start + n)
            if layer.attn_type != AttentionType.ENCODER_ONLY:
                in_block = in_block & (cols - start <= torch.arange(n, device=lens.device)[None, :, None])
            mask = (cols < start) | in_block  # [b, n, width]
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            qq = q.reshape(b, n, hq, d).transpose(1, 2)
            flat = rows.reshape(-1)
            kk = k_buf.index_select(0, flat).view(b, width, hkv, d).transpose(1, 2).to(qq.dtype)
            vv = v_buf.index_select(0, flat).view(b, width, hkv, v_buf.shape[-1]).transpose(1, 2).to(qq.dtype)
            out = sdpa(qq, kk, vv, attn_mask=mask[:, None], scale=layer.scaling, enable_gqa=hq != hkv)
            return out.transpose(1, 2).reshape(b * n, hq * layer.v_head_dim)

    return DFlashPeerAttnBackend


# -- 3. the draft's input embeddings in the model's dtype --------------------------------------------------------
def _extend_kwargs_hook(original, runner, forward_batch, *args, **kwargs):
    out = original(runner, forward_batch, *args, **kwargs)
    emb = forward_batch.input_embeds
    if emb is not None and forward_batch.replace_embeds is None and "input_embeds" in out:
        out["input_embeds"] = emb.to(runner.dtype)
    return out


# -- 4. record_stream on CPU tensors -------------------------------------------------------------------------------
def _patch_record_stream() -> None:
    import torch

    from jetflow_sglang.sglang.compat import wrap

    def make(original):
        @functools.wraps(original)
        def record_stream(self, stream):
            if self.device.type == "cpu":
                return None  # a CPU tensor belongs to no stream
            return original(self, stream)
        return record_stream

    wrap(torch.Tensor, "record_stream", make)


# -- 5. no fused Triton q/k-norm + RoPE kernel on a CPU -------------------------------------------------------------
def _draft_attention_init_hook(original, layer, *args, **kwargs):
    out = original(layer, *args, **kwargs)
    layer.use_table_qk_norm_rope = False  # the torch path (apply_qk_norm + rotary) computes the same on a CPU
    return out
