"""Head checkpoints: an HF-style folder with config.json + model.safetensors (embeddings/LM head not included)."""
from __future__ import annotations

from pathlib import Path

import torch

from .config import CheckpointError, JetFlowHeadConfig
from .model import JetFlowHead


def save_head(head: JetFlowHead, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head.config.save(out / "config.json")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "model_type": "jetflow_head"})
    return out


def load_head(head_dir, target=None, dtype: torch.dtype | None = None, device=None) -> JetFlowHead:
    """Load a head and, when `target` (an HF model or our Target) is given, check and bind it to that target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(head_dir)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no draft-head checkpoint at {path} (expected config.json and model.safetensors)")
    cfg = JetFlowHeadConfig.load(path / "config.json")
    model = target.model if hasattr(target, "tap_layers") else target  # our Target wraps the HF model
    if model is not None:
        cfg.check_target(model.config)  # fail before reading weights
    head = JetFlowHead(cfg)
    try:
        state = load_file(str(path / "model.safetensors"))
        head.load_state_dict(state, strict=True)
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"corrupt or incompatible head weights in {path}: {e}") from e
    if model is not None:  # the head runs beside its target: same dtype and device unless asked otherwise
        dtype = dtype or next(model.parameters()).dtype
        device = device or next(model.parameters()).device
    head = head.to(device=device, dtype=dtype) if dtype is not None else head.to(device=device)
    head.eval().requires_grad_(False)
    return head.bind(model) if model is not None else head
