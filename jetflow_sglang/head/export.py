"""Export a head into the DFlash-style release layout (the inverse of formats.py, which reads it).

Two flavours of the one layout:

- "jetspec": a causal head (JetFlow / JetSpec releases): `dflash_config.causal_head: true`, plus `is_causal: true`
  and `layer_types` (all full attention) at the top level, which SGLang's own DFLASH reads instead of causal_head.
- "dflash": a bidirectional head (DFlash releases): no `causal_head` key, as those releases have it.

The export is exact or refused: readers of the layout always apply q/k norms, take the argmax over the full target
vocabulary and embed mask slots with the target's embedding of `mask_token_id`, so a head with `qk_norm: false`, a
draft vocabulary or a learned mask vector is refused with one line naming each (train such heads with
`scripts/train_head.py --release-layout`). Tensors keep their values and dtype; `torch_dtype` states that dtype
(SGLang's DFLASH loads a head without it in bfloat16).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from jetflow_sglang.head.config import CheckpointError, JetFlowHeadConfig

FORMATS = ("jetspec", "dflash")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")
_DROPPED = ("mask_embedding", "vocab_ids")  # unused by a head that embeds mask_token_id; full-vocabulary ids


class ExportError(CheckpointError):
    """A head cannot be written exactly in the release layout asked for."""


def exactness_problems(cfg: JetFlowHeadConfig) -> list[str]:
    """What stops `cfg` from being expressed exactly in the release layout (empty: nothing)."""
    problems = []
    if not cfg.qk_norm:
        problems.append("qk_norm is false (the layout always applies q/k norms)")
    if cfg.draft_vocab_size:
        problems.append(f"draft_vocab_size is {cfg.draft_vocab_size} (readers take the argmax over the full "
                        "target vocabulary)")
    if cfg.mask_token_id is None:
        problems.append("mask_token_id is unset: the head has a learned mask vector (readers embed mask slots with "
                        "the target's embedding of mask_token_id)")
    return problems


def release_mask_token_id(tokenizer, vocab_size: int) -> tuple[int, str]:
    """(mask_token_id, the rule that chose it) for a head trained in the release layout.

    The first embedding row past the tokenizer's tokens when the target has spare rows (what the JetSpec and DFlash
    Qwen3 heads use: 151669), so no real token is ever confused with a mask slot; otherwise the tokenizer's unk, pad,
    or eos token, the first that exists."""
    n = len(tokenizer)
    if n < vocab_size:
        return n, "first embedding row past the tokenizer"
    for name in ("unk", "pad", "eos"):
        tid = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < vocab_size:
            return tid, f"tokenizer {name}_token"
    raise ValueError("cannot choose a mask token: the target's embedding has no spare row and its tokenizer has no "
                     "unk, pad or eos token (pass --mask-token-id)")


def release_config(cfg: JetFlowHeadConfig, fmt: str, torch_dtype: str, target_dir=None) -> dict:
    """The release config.json of head config `cfg` (already checked for exactness)."""
    target = _target_fields(target_dir) if target_dir is not None else {}
    model_type = cfg.target.get("model_type") or cfg.extra.get("model_type") or target.get("model_type")
    n_target = cfg.target.get("num_hidden_layers") or target.get("num_hidden_layers")
    if not model_type:
        raise ExportError("the head's config does not name its target's model_type; pass the target's folder "
                          "(--target) to take it from there")
    dcfg = {"target_layer_ids": list(cfg.tap_layers), "mask_token_id": cfg.mask_token_id}
    if fmt == "jetspec":
        dcfg["causal_head"] = True
    out = {"architectures": ["DFlashDraftModel"], "model_type": model_type, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "vocab_size": cfg.target["vocab_size"], "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * cfg.num_layers, "block_size": cfg.block_size}
    if fmt == "jetspec":
        out["is_causal"] = True
    if n_target:
        out["num_target_layers"] = n_target
    if target.get("max_position_embeddings"):
        out["max_position_embeddings"] = target["max_position_embeddings"]
    out.update({"dflash_config": dcfg, "torch_dtype": torch_dtype, "dtype": torch_dtype})
    return out


def release_state(state: dict, where) -> dict:
    """This project's tensor names -> the release layout's (layers.N.self_attn.*, layers.N.mlp.*)."""
    out = {}
    for name, tensor in state.items():
        if name in _DROPPED:
            continue
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2] in _ATTN:
            name = f"layers.{parts[1]}.self_attn.{parts[2]}.{parts[3]}"
        elif len(parts) == 4 and parts[0] == "layers" and parts[2] in _MLP:
            name = f"layers.{parts[1]}.mlp.{parts[2]}.{parts[3]}"
        out[name] = tensor.contiguous()
    return out


def export_head(src_dir, out_dir, fmt: str, target_dir=None) -> Path:
    """Write the head in `src_dir` (this project's format or a release) to `out_dir` in release layout `fmt`
    ("jetspec": causal heads, "dflash": bidirectional ones): config.json + model.safetensors, no embedding / LM head.

    target_dir (an HF model folder, optional): the head is checked against that target (architecture, sizes,
    vocabulary, taps, mask_token_id), and the release config takes the target's model_type and layer count where the
    head's config lacks them (a release read without num_target_layers) and its max_position_embeddings.
    Raises a one-line ExportError / CheckpointError / HeadMismatchError. Returns `out_dir`."""
    from safetensors.torch import save_file

    from jetflow_sglang.head.check import check_head_files
    from jetflow_sglang.head.formats import DFLASH, dflash_state
    from jetflow_sglang.head.io import _read_weights, locate_head, read_head_config

    if fmt not in FORMATS:
        raise ExportError(f"unknown release format {fmt!r}; expected one of {', '.join(FORMATS)}")
    src, out = locate_head(src_dir), Path(out_dir)
    cfg, src_fmt = read_head_config(src)
    kind = "causal" if cfg.causal else "bidirectional"
    if cfg.causal != (fmt == "jetspec"):
        raise ExportError(f"{src} holds a {kind} head: export it as {'jetspec' if cfg.causal else 'dflash'}, "
                          f"not {fmt}")
    problems = exactness_problems(cfg)
    if problems:
        raise ExportError(f"cannot export {src} exactly as {fmt}: " + "; ".join(problems)
                          + " (train with scripts/train_head.py --release-layout)")
    check_head_files(src, target_dir)  # names, shapes, file integrity; against the target when given
    state = _read_weights(src)
    if src_fmt == DFLASH:
        state = dflash_state(state, src)
    state = release_state(state, src)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    if len(dtypes) != 1:
        raise ExportError(f"{src} holds tensors of several dtypes ({', '.join(dtypes)}); the release layout states "
                          "one torch_dtype")
    raw = release_config(cfg, fmt, dtypes[0], target_dir)
    _write(out, src, raw, state, save_file)
    back, back_fmt = read_head_config(out)  # what a reader makes of it: the same head
    if back_fmt != DFLASH or _core(back) != _core(cfg):
        raise ExportError(f"the export in {out} does not read back as the head in {src}")
    check_head_files(out, target_dir)
    return out


def _write(out: Path, src: Path, raw: dict, state: dict, save_file) -> None:
    if out.resolve() == src.resolve():
        raise ExportError(f"the output folder {out} is the head's own folder; choose another")
    if out.exists() and not out.is_dir():
        raise ExportError(f"the output {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    stray = sorted(p.name for p in out.glob("*.safetensors") if p.name != "model.safetensors")
    if stray:
        raise ExportError(f"{out} already holds {', '.join(stray)}, which readers would load with the export; "
                          "choose an empty folder")
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private; the export is as readable as any file written here
        os.replace(tmp, out / "model.safetensors")
    finally:
        Path(tmp).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def _core(cfg: JetFlowHeadConfig) -> tuple:
    """The fields that decide a head's outputs (the target's identity and provenance aside)."""
    return (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            list(cfg.tap_layers), cfg.rms_norm_eps, cfg.rope_theta, cfg.qk_norm, cfg.block_size, cfg.causal,
            cfg.draft_vocab_size, cfg.mask_token_id, cfg.target["vocab_size"])


def _target_fields(target_dir) -> dict:
    from jetflow_sglang.head.check import target_config_of
    from jetflow_sglang.paths import resolve_dir

    if target_config_of(target_dir) is None:
        raise ExportError(f"--target {target_dir}: not a model folder with a readable config.json (hidden_size, "
                          "vocab_size, num_hidden_layers)")
    raw = json.loads((resolve_dir(target_dir, "target model folder") / "config.json").read_text())
    text = raw.get("text_config")
    src = text if isinstance(text, dict) and "hidden_size" not in raw else raw  # a multimodal target: its text model
    return {k: src.get(k) for k in ("model_type", "num_hidden_layers", "max_position_embeddings")}


__all__ = ["FORMATS", "ExportError", "exactness_problems", "export_head", "release_config", "release_mask_token_id",
           "release_state"]
