"""Head configuration, including the identity of the target it was built for."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class CheckpointError(RuntimeError):
    """A head checkpoint is missing, unreadable or corrupt."""


class HeadMismatchError(ValueError):
    """A head was built for a different target model."""


def default_tap_layers(num_layers: int, n_taps: int) -> list[int]:
    """DFlash/JetSpec rule: spread taps from layer 1 to layer L-3 (outputs of those decoder layers)."""
    if n_taps == 1:
        return [num_layers - 1]
    return [round(1 + i * (num_layers - 4) / (n_taps - 1)) for i in range(n_taps)]


def target_signature(target_config) -> dict:
    arch = (getattr(target_config, "architectures", None) or [type(target_config).__name__])[0]
    return {
        "architecture": arch,
        "model_type": getattr(target_config, "model_type", ""),
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_hidden_layers": target_config.num_hidden_layers,
    }


@dataclass
class JetFlowHeadConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tap_layers: list[int]
    target: dict
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = False
    block_size: int = 16
    causal: bool = True
    draft_vocab_size: int = 0  # 0: the target's full vocabulary
    extra: dict = field(default_factory=dict)  # free-form provenance (training command, data, steps)

    @classmethod
    def for_target(cls, target_config, num_layers: int = 2, n_taps: int = 4, causal: bool = True,
                   draft_vocab_size: int = 0, block_size: int = 16) -> "JetFlowHeadConfig":
        tc = target_config
        heads = tc.num_attention_heads
        return cls(
            hidden_size=tc.hidden_size, num_layers=num_layers, num_heads=heads,
            num_kv_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            tap_layers=default_tap_layers(tc.num_hidden_layers, n_taps),
            target=target_signature(tc), rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(tc), qk_norm=getattr(tc, "model_type", "") in ("qwen3", "qwen3_moe"),
            block_size=block_size, causal=causal, draft_vocab_size=draft_vocab_size)

    def check_target(self, target_config) -> None:
        have = target_signature(target_config)
        diffs = [f"{k}: head expects {self.target.get(k)!r}, target has {have[k]!r}"
                 for k in ("architecture", "hidden_size", "vocab_size", "num_hidden_layers") if self.target.get(k) != have[k]]
        if diffs:
            raise HeadMismatchError("this draft head was built for another target model (" + "; ".join(diffs) + ")")
        if max(self.tap_layers) >= have["num_hidden_layers"]:
            raise HeadMismatchError(f"tap layers {self.tap_layers} do not exist in a {have['num_hidden_layers']}-layer target")

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"model_type": "jetflow_head", **asdict(self)}, indent=2))

    @classmethod
    def load(cls, path: Path) -> "JetFlowHeadConfig":
        try:
            raw = json.loads(Path(path).read_text())
            raw.pop("model_type", None)
            return cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"cannot read head config {path}: {e}") from e


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(tc, "rope_theta", 10000.0))
