"""Check a head folder against its target from the files alone: no weights are read, no model is built.

`check_head_files(head_dir, target_config)` is what a launcher calls before it loads the target, so that a head that
cannot work fails in well under a second with one line instead of after the target has loaded:

  - config.json: readable, either format (read_head_config);
  - the target (its config.json, or its HF config): architecture / hidden size / vocabulary / layer count the head
    was built for, the head's hidden_size, its tap layers, mask_token_id and draft vocabulary (check_target); with
    `sglang=True` also SGLang's capture rule: taps ascending and below num_hidden_layers - 1;
  - every *.safetensors file: an 8-byte header length, a JSON header, each tensor's byte range inside the file and of
    the size its dtype and shape imply, the ranges tiling the data to exactly the end of the file (a truncated or
    padded file fails here);
  - the tensor names and shapes the config implies (the same rule and message as load_head's check_state).
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from types import SimpleNamespace

from jetflow_sglang.head.config import CheckpointError, HeadMismatchError, JetFlowHeadConfig

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers")


def read_safetensors_header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, read from its header only, after checking that the header
    is JSON and that the tensors' byte ranges tile the data section exactly up to the end of the file.
    One-line CheckpointError naming the file and both values otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"corrupt head weights {path}: the file has {size} bytes, fewer than the "
                                      "8-byte safetensors header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"corrupt or truncated head weights {path}: the header claims {n} bytes, but "
                                      f"the file has {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read head weights {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"corrupt head weights {path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt head weights {path}: the safetensors header is a {type(header).__name__}, "
                              "not an object")
    data_len = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        bad = CheckpointError(f"corrupt head weights {path}: tensor {name!r} has a malformed header entry {info!r}")
        if not isinstance(info, dict):
            raise bad
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) \
                or len(offsets) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                            for v in shape + offsets) or offsets[0] > offsets[1]:
            raise bad
        out[name] = (dtype, tuple(shape))
        spans.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    end = max((e for _b, e, *_ in spans), default=0)
    if end > data_len:
        raise CheckpointError(f"truncated head weights {path}: the file has {size} bytes, its header says "
                              f"{8 + n + end}")
    at = 0
    for begin, end, name, dtype, shape in sorted(spans):
        if begin != at:
            raise CheckpointError(f"corrupt head weights {path}: tensor {name!r} starts at data byte {begin}, "
                                  f"expected {at} (gap or overlap in the header's data_offsets)")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"corrupt head weights {path}: tensor {name!r} ({dtype}, shape {shape}) needs "
                                  f"{math.prod(shape) * DTYPE_BYTES[dtype]} bytes, its header gives {end - begin}")
        at = end
    if at != data_len:
        raise CheckpointError(f"corrupt head weights {path}: the file has {size} bytes, its header says "
                              f"{8 + n + at} ({size - 8 - n - at} bytes too many)")
    return out


def target_config_of(model_path) -> SimpleNamespace | None:
    """The fields of a target's config.json that a head is checked against (architectures, model_type, hidden_size,
    vocab_size, num_hidden_layers; a multimodal config's text_config is used when the top level lacks them), or None
    when `model_path` is not a local folder (or a repo id in the local hub cache) with a readable config.json, or its
    config lacks these fields: then the launcher's own model loading reports it."""
    from jetflow_sglang.paths import resolve_dir

    if not model_path:
        return None
    try:
        folder = resolve_dir(model_path, "target model folder")
        raw = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError, UnicodeDecodeError):
        return None
    return _target_fields(raw)


def _target_fields(raw) -> SimpleNamespace | None:
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    src = text if isinstance(text, dict) and not all(k in raw for k in TARGET_FIELDS) else raw
    values = {k: src.get(k) for k in TARGET_FIELDS}
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values.values()):
        return None
    return SimpleNamespace(architectures=raw.get("architectures") or None, model_type=raw.get("model_type", ""),
                           **values)


def _as_target(target_config):
    """An object with the fields check_target reads: an HF config as it is; a dict (config.json) or a folder path
    through `_target_fields`; None when it lacks them."""
    if target_config is None:
        return None
    if isinstance(target_config, (str, Path)):
        target_config = target_config_of(target_config)
    elif isinstance(target_config, dict):
        target_config = _target_fields(target_config)
    elif not hasattr(target_config, "hidden_size") and hasattr(target_config, "get_text_config"):
        target_config = target_config.get_text_config()
    if target_config is None or not all(hasattr(target_config, k) for k in TARGET_FIELDS):
        return None
    return target_config


def check_taps_for_sglang(cfg: JetFlowHeadConfig, num_hidden_layers: int) -> None:
    """SGLang captures tap l as the input of decoder layer l + 1, in layer order: taps ascending, < num_layers - 1.
    (The same rule JetFlowWorker._load_head enforces after loading.)"""
    taps = list(cfg.tap_layers)
    if taps != sorted(taps) or len(set(taps)) != len(taps):
        raise HeadMismatchError(f"head tap_layers {taps} are not strictly ascending (SGLang captures them in "
                                f"layer order); expected {sorted(set(taps))}")
    last = num_hidden_layers - 2
    if taps[-1] > last:
        raise HeadMismatchError(f"head tap layer {taps[-1]} (tap_layers {taps}) is beyond what SGLang can capture "
                                f"in a {num_hidden_layers}-layer target: taps must be <= {last} "
                                f"(num_hidden_layers - 2)")


def _expected_tensors(cfg: JetFlowHeadConfig, fmt: str, found: dict, where: Path) -> None:
    """The header's names and shapes against those the config implies (load_head's check_state, on meta tensors)."""
    import torch

    from jetflow_sglang.head.formats import DFLASH, dflash_state
    from jetflow_sglang.head.io import check_state
    from jetflow_sglang.head.model import JetFlowHead

    with torch.device("meta"):
        head = JetFlowHead(cfg)
        state = {k: torch.empty(shape) for k, (_dtype, shape) in found.items()}
    if fmt == DFLASH:
        state = dflash_state(state, where)
        own = head.state_dict()
        state.setdefault("mask_embedding", own["mask_embedding"])
        state.setdefault("vocab_ids", own["vocab_ids"])
    check_state(head, state, where)


def check_head_files(head_dir, target_config=None, *, sglang: bool = False) -> JetFlowHeadConfig:
    """Check the head folder `head_dir` against `target_config` (an HF config, a config.json dict, a target folder,
    or None to check the head alone) without reading any weight; return the head's config.

    sglang=True adds SGLang's tap-capture rule (check_taps_for_sglang). Raises a one-line CheckpointError (files)
    or HeadMismatchError (head vs target)."""
    from jetflow_sglang.head.io import locate_head, read_head_config

    path = locate_head(head_dir)
    target = _as_target(target_config)
    cfg, fmt = read_head_config(path, target)  # a release config without tap ids takes the target's depth
    if target is not None:
        if isinstance(target, SimpleNamespace) and not target.architectures:  # config.json names none: no check
            target = SimpleNamespace(**{**vars(target), "architectures": [cfg.target.get("architecture")]})
        if sglang and cfg.target.get("num_hidden_layers") in (None, target.num_hidden_layers):
            check_taps_for_sglang(cfg, target.num_hidden_layers)  # before check_target's looser 0..L-1 range
        cfg.check_target(target)  # (a head built for another layer count fails here, so the taps were checked)
        vocab = target.vocab_size
        if cfg.draft_vocab_size > vocab:
            raise HeadMismatchError(f"head draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary "
                                    f"({vocab})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no weights in {path} (expected model.safetensors)")
    found: dict = {}
    for f in files:
        for name, spec in read_safetensors_header(f).items():
            if name in found:
                raise CheckpointError(f"head weights in {path}: tensor {name!r} appears in more than one file")
            found[name] = spec
    _expected_tensors(cfg, fmt, found, path)
    return cfg


__all__ = ["check_head_files", "check_taps_for_sglang", "read_safetensors_header", "target_config_of"]
