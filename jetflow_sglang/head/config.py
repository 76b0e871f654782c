"""Head configuration, including the identity of the target it was built for."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


class CheckpointError(RuntimeError):
    """A head checkpoint is missing, unreadable or corrupt."""


class HeadMismatchError(ValueError):
    """A head was built for a different target model."""


def default_tap_layers(num_layers: int, n_taps: int) -> list[int]:
    """DFlash/JetSpec rule: spread taps from layer 1 to layer L-3 (outputs of those decoder layers)."""
    if n_taps == 1:
        return [num_layers - 1]
    if num_layers < 4:  # too shallow for the rule (it would reach layer -1): spread over every layer, ascending
        return [round(i * (num_layers - 1) / (n_taps - 1)) for i in range(n_taps)]
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
    # Released (DFlash-style) heads have no learned mask embedding: mask slots embed this token with the target's
    # embedding. None: the head's own `mask_embedding` (this project's format).
    mask_token_id: int | None = None
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

    def validate(self, where: str = "head config") -> "JetFlowHeadConfig":
        """Reject values that cannot describe a working head, naming the field (one line each)."""
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "block_size"):
            _need_int(where, name, getattr(self, name), 2 if name == "block_size" else 1)
        _need_int(where, "draft_vocab_size", self.draft_vocab_size, 0)
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"{where}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"{where}: head_dim={self.head_dim} must be even (rotary embedding)")
        if not isinstance(self.tap_layers, list) or not self.tap_layers:
            raise CheckpointError(f"{where}: tap_layers must be a non-empty list of layer indices; got {self.tap_layers!r}")
        for i, layer in enumerate(self.tap_layers):
            _need_int(where, f"tap_layers[{i}]", layer, 0)
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CheckpointError(f"{where}: {name} must be a finite number > 0; got {v!r}")
        if not isinstance(self.causal, bool) or not isinstance(self.qk_norm, bool):
            raise CheckpointError(f"{where}: causal and qk_norm must be true/false; got {self.causal!r}, {self.qk_norm!r}")
        if not isinstance(self.target, dict):
            raise CheckpointError(f"{where}: target must be an object; got {self.target!r}")
        if self.mask_token_id is not None:
            _need_int(where, "mask_token_id", self.mask_token_id, 0)
        return self

    def check_target(self, target_config) -> None:
        have = target_signature(target_config)
        diffs = [f"{k}: head expects {self.target.get(k)!r}, target has {have[k]!r}"
                 for k in ("architecture", "hidden_size", "vocab_size", "num_hidden_layers")
                 if self.target.get(k) is not None and self.target.get(k) != have[k]]
        if diffs:
            raise HeadMismatchError("this draft head was built for another target model (" + "; ".join(diffs) + ")")
        if self.hidden_size != have["hidden_size"]:  # the head embeds with the target's embedding
            raise HeadMismatchError(f"head hidden_size {self.hidden_size} differs from the target's {have['hidden_size']}")
        bad = [t for t in self.tap_layers if not 0 <= t < have["num_hidden_layers"]]
        if bad:
            raise HeadMismatchError(f"tap layers {bad} of {self.tap_layers} do not exist in a "
                                    f"{have['num_hidden_layers']}-layer target (valid: 0..{have['num_hidden_layers'] - 1})")
        if self.mask_token_id is not None and self.mask_token_id >= have["vocab_size"]:
            raise HeadMismatchError(f"mask_token_id {self.mask_token_id} is outside the target's vocabulary ({have['vocab_size']})")

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"model_type": "jetflow_head", **asdict(self)}, indent=2))

    @classmethod
    def load(cls, path: Path) -> "JetFlowHeadConfig":
        return cls.from_dict(read_config(path), str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "head config") -> "JetFlowHeadConfig":
        raw = {k: v for k, v in raw.items() if k != "model_type"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CheckpointError(f"cannot read head config {where}: unknown field(s) {', '.join(unknown)}")
        missing = [n for n in _REQUIRED if n not in raw]
        if missing:
            raise CheckpointError(f"cannot read head config {where}: missing field(s) {', '.join(missing)}")
        return cls(**raw).validate(where)


_REQUIRED = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "tap_layers", "target")


def read_config(path) -> dict:
    """config.json as a dict, or a one-line CheckpointError (unreadable, not JSON, not an object)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read head config {path}: {e}") from e
    except ValueError as e:
        raise CheckpointError(f"cannot read head config {path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"cannot read head config {path}: expected a JSON object, found a {type(raw).__name__}")
    return raw


def _need_int(where: str, name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where}: {name} must be an integer >= {minimum}; got {value!r}")


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(tc, "rope_theta", 10000.0))
