"""Head checkpoints: an HF-style folder with config.json + *.safetensors (embeddings/LM head not included).

`load_head` reads this project's format and the released DFlash-style format (formats.py) alike; the format is
detected from config.json.
"""
from __future__ import annotations

from pathlib import Path

import torch

from jetflow_sglang.head.config import CheckpointError, JetFlowHeadConfig, read_config
from jetflow_sglang.head.formats import DFLASH, detect_format, dflash_config, dflash_state
from jetflow_sglang.head.model import JetFlowHead


def save_head(head: JetFlowHead, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head.config.save(out / "config.json")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "model_type": "jetflow_head"})
    return out


def locate_head(head_dir) -> Path:
    """A local head folder; a Hugging Face repo id ("z-lab/Qwen3-8B-DFlash-b16") resolves to its local hub cache."""
    from jetflow_sglang.paths import looks_like_repo_id, resolve_dir

    if looks_like_repo_id(str(head_dir)):
        try:
            return resolve_dir(head_dir, "draft-head checkpoint")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return Path(head_dir)


def read_head_config(head_dir, target_config=None) -> tuple[JetFlowHeadConfig, str]:
    """(config, format) of a head folder, without reading weights. One-line CheckpointError on anything wrong."""
    path = locate_head(head_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no draft-head checkpoint at {path} (expected config.json and model.safetensors)")
    raw = read_config(path / "config.json")
    where = str(path / "config.json")
    fmt = detect_format(raw, where)
    cfg = dflash_config(raw, where, target_config) if fmt == DFLASH else JetFlowHeadConfig.from_dict(raw, where)
    return cfg, fmt


def _read_weights(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no weights in {path} (expected model.safetensors)")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (OSError, SafetensorError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"corrupt or incompatible head weights in {f}: {' '.join(str(e).split())}") from e
    return state


def check_state(head: JetFlowHead, state: dict, where) -> None:
    """Every expected tensor present with the shape the config implies; nothing unknown. One line naming the field."""
    own = head.state_dict()
    missing = [k for k in own if k not in state]
    unknown = [k for k in state if k not in own]
    if missing:
        raise CheckpointError(f"head weights in {where} lack {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    if unknown:
        raise CheckpointError(f"head weights in {where} hold {len(unknown)} unknown tensor(s), e.g. {', '.join(unknown[:3])}")
    c = head.config
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"head tensor {k} in {where} has shape {tuple(state[k].shape)}, but config.json (hidden_size="
                f"{c.hidden_size}, num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"intermediate_size={c.intermediate_size}, {len(c.tap_layers)} taps) implies {tuple(v.shape)}")


def load_head(head_dir, target=None, dtype: torch.dtype | None = None, device=None) -> JetFlowHead:
    """Load a head and, when `target` (an HF model or our Target) is given, check and bind it to that target."""
    path = locate_head(head_dir)
    model = target.model if hasattr(target, "tap_layers") else target  # our Target wraps the HF model
    cfg, fmt = read_head_config(path, model.config if model is not None else None)
    if model is not None:
        cfg.check_target(model.config)  # fail before reading weights
    head = JetFlowHead(cfg)
    state = _read_weights(path)
    if fmt == DFLASH:  # released heads: no learned mask embedding, full vocabulary
        state = dflash_state(state, path)
        own = head.state_dict()
        state.setdefault("mask_embedding", own["mask_embedding"])
        state.setdefault("vocab_ids", own["vocab_ids"])
    check_state(head, state, path)
    head.load_state_dict(state, strict=True)
    head.eval().requires_grad_(False)
    return attach_head(head, target, dtype, device) if model is not None else head.to(device=device, dtype=dtype)


def attach_head(head: JetFlowHead, target, dtype: torch.dtype | None = None, device=None) -> JetFlowHead:
    """Check a loaded head against its target, move it beside the target (same dtype and device unless asked
    otherwise) and bind the target's embedding and LM head."""
    model = target.model if hasattr(target, "tap_layers") else target
    head.config.check_target(model.config)
    dtype = dtype or next(model.parameters()).dtype
    device = device or next(model.parameters()).device
    return head.to(device=device, dtype=dtype).bind(model)
