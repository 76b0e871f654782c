"""Released head formats, read directly (no conversion step).

Two layouts are recognised from config.json:

- "jetflow": this project's own format (`model_type: jetflow_head`, see config.py).
- "dflash": the DFlash-style release layout used by the DFlash heads (z-lab/*-DFlash-b16, bidirectional) and by the
  JetFlow/JetSpec releases (same layout with `dflash_config.causal_head: true`). The config is a Qwen3-style decoder
  config (`num_hidden_layers` = draft layers) plus `block_size`, `num_target_layers` and a `dflash_config` holding
  `target_layer_ids`, `mask_token_id` and optionally `causal_head`. The weights are `layers.N.self_attn.{q,k,v,o}_proj`,
  `layers.N.self_attn.{q,k}_norm`, `layers.N.mlp.{gate,up,down}_proj`, `layers.N.{input,post_attention}_layernorm`,
  `fc`, `hidden_norm` and `norm` (optionally prefixed `model.`); the embedding and LM head are the target's, and mask
  slots embed `mask_token_id` with the target's embedding.
"""
from __future__ import annotations

from jetflow_sglang.head.config import CheckpointError, JetFlowHeadConfig

JETFLOW, DFLASH = "jetflow", "dflash"


def detect_format(raw: dict, where: str) -> str:
    if raw.get("model_type") == "jetflow_head":
        return JETFLOW
    if "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or []):
        return DFLASH
    raise CheckpointError(f"{where}: not a draft-head config (expected model_type 'jetflow_head', or a DFlash-style "
                          f"config with 'dflash_config'); model_type is {raw.get('model_type')!r}")


def _get(raw: dict, dcfg: dict, name: str, default=None):
    return dcfg[name] if name in dcfg else raw.get(name, default)


def _rope_theta(raw: dict, where: str) -> float:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    for key, rope in (("rope_scaling", scaling), ("rope_parameters", params)):
        if not isinstance(rope, dict):
            raise CheckpointError(f"{where}: {key} must be an object; got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"{where}: unsupported {key}.rope_type {kind!r} (only plain RoPE heads are supported)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta


def _dflash_taps(n_draft: int, n_target: int) -> list[int]:
    """DFlash's default when a config gives no target_layer_ids: spread over layers 1..L-3 (1 layer: the middle)."""
    if n_draft == 1:
        return [n_target // 2]
    return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


def _reject_unsupported(raw: dict, dcfg: dict, where: str) -> None:
    if raw.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true is not supported (JetFlow heads have no projection biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    types = raw.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise CheckpointError(f"{where}: layer_types {types!r} are not supported (only 'full_attention')")
    if dcfg.get("draft_shift"):
        raise CheckpointError(f"{where}: dflash_config.draft_shift=true is not supported (slot j must predict depth j)")
    for name in ("projector_type", "conv_kernel_size", "selector_rank", "attention_sink_bias"):
        if dcfg.get(name):
            raise CheckpointError(f"{where}: dflash_config.{name}={dcfg[name]!r} is not supported")
    if raw.get("has_embed_tokens") or raw.get("has_lm_head"):
        raise CheckpointError(f"{where}: heads with their own embed_tokens / lm_head are not supported "
                              "(the head must share the target's)")
    ths = dcfg.get("target_hidden_size")
    if ths is not None and ths != raw.get("hidden_size"):
        raise CheckpointError(f"{where}: dflash_config.target_hidden_size={ths!r} differs from hidden_size="
                              f"{raw.get('hidden_size')!r} (hidden-size adapters are not supported)")


def dflash_config(raw: dict, where: str, target_config=None) -> JetFlowHeadConfig:
    """A DFlash-style release config -> JetFlowHeadConfig. The target identity is what the release states."""
    dcfg = raw.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise CheckpointError(f"{where}: dflash_config must be an object; got {dcfg!r}")
    _reject_unsupported(raw, dcfg, where)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if k not in raw]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(missing)}")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    n_target = _get(raw, dcfg, "num_target_layers")
    taps = _get(raw, dcfg, "target_layer_ids")
    if taps is None:
        layers = n_target if n_target is not None else getattr(target_config, "num_hidden_layers", None)
        if not isinstance(layers, int) or not isinstance(raw["num_hidden_layers"], int):
            raise CheckpointError(f"{where}: dflash_config.target_layer_ids is missing and num_target_layers is unknown")
        taps = _dflash_taps(raw["num_hidden_layers"], layers)
    elif not isinstance(taps, list):
        raise CheckpointError(f"{where}: dflash_config.target_layer_ids must be a list of layer ids; got {taps!r}")
    mask_id = _get(raw, dcfg, "mask_token_id")
    if mask_id is None:
        raise CheckpointError(f"{where}: dflash_config.mask_token_id is missing (the token mask slots embed)")
    causal = dcfg.get("causal_head", False)
    if not isinstance(causal, bool):
        raise CheckpointError(f"{where}: dflash_config.causal_head must be true or false; got {causal!r}")
    head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else 0)
    cfg = JetFlowHeadConfig(
        hidden_size=hidden, num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=raw["intermediate_size"], tap_layers=taps,
        target={"architecture": None, "model_type": None, "hidden_size": hidden, "vocab_size": raw["vocab_size"],
                "num_hidden_layers": n_target},
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(raw, where), qk_norm=True,
        block_size=_get(raw, dcfg, "block_size", 16), causal=causal, draft_vocab_size=0, mask_token_id=mask_id,
        extra={"format": DFLASH, "architectures": raw.get("architectures"), "model_type": raw.get("model_type")})
    for name, value in (("num_hidden_layers", cfg.num_layers), ("block_size", cfg.block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "block_size" else 1):
            raise CheckpointError(f"{where}: {name} must be an integer >= {2 if name == 'block_size' else 1}; got {value!r}")
    if n_target is not None and (isinstance(n_target, bool) or not isinstance(n_target, int) or n_target < 1):
        raise CheckpointError(f"{where}: num_target_layers must be an integer >= 1; got {n_target!r}")
    for i, t in enumerate(taps):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (n_target is not None and t >= n_target):
            raise CheckpointError(f"{where}: dflash_config.target_layer_ids[{i}]={t!r} is not a layer of a "
                                  f"{n_target}-layer target" if n_target else
                                  f"{where}: dflash_config.target_layer_ids[{i}]={t!r} is not a layer index")
    return cfg.validate(where)


def dflash_state(state: dict, where: str) -> dict:
    """Release tensor names -> this project's module names (rotary caches dropped)."""
    out = {}
    for name, tensor in state.items():
        key = name[len("model."):] if name.startswith("model.") else name
        if "rotary_emb" in key:
            continue
        key = key.replace(".self_attn.", ".").replace(".mlp.", ".")
        if key in out:
            raise CheckpointError(f"{where}: tensor {name!r} appears twice (with and without the 'model.' prefix)")
        out[key] = tensor
    return out
