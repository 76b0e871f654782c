"""The one place that assembles target + head + drafter (CLI, explorer and benchmarks all call `load_stack`).

Everything that can be checked without loading weights is checked first (`check_stack_args`, the head's config
against the target's config), so bad input fails in well under a second with one line.
"""
from __future__ import annotations

import re
from pathlib import Path

from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.draft.fit import drafter_for
from jetflow_sglang.head import attach_head, check_head_files, load_head, read_head_config
from jetflow_sglang.paths import DEFAULT_HEAD_DIR, bidir_dir, default_paths, resolve_dir
from jetflow_sglang.draft.registry import BIDIRECTIONAL_DRAFTERS, DEFAULT_WIDTH, DRAFTERS, REGISTRY, TREES, spec

EXACT_MODES = ("on", "off")
DTYPE_NAMES = ("auto", "bfloat16", "float32", "float16", "bf16", "fp32", "fp16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
NO_HEAD = tuple(n for n, s in REGISTRY.items() if s.head is None)


def check_device(device: str) -> str:
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N; got {device!r}")
    return device


def check_stack_args(drafter: str | None, width, device: str, tree: str, depth, dtype: str, exact: str = "off") -> None:
    """Cheap validation of everything load_stack takes, before any model is read."""
    if drafter is not None:
        spec(drafter)  # an unknown name: one line with the registry's names
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an integer >= 1; got {width!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be an integer >= 1; got {depth!r}")
    if tree not in TREES:
        raise ValueError(f"tree must be one of {', '.join(TREES)}; got {tree!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    if exact not in EXACT_MODES:
        raise ValueError(f"exact must be one of {', '.join(EXACT_MODES)}; got {exact!r}")
    check_device(device)


def _check_device_present(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}, but this torch ({torch.__version__}) sees no CUDA device")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}, but only {torch.cuda.device_count()} CUDA device(s) are visible")


def pick_head(head_dir, drafter: str | None, target_config=None):
    """(head folder, its config, the drafter to run). Bidirectional drafters on a causal head use the `-bidir`
    head next to it when there is one; a head that does not fit the drafter is a one-line HeadMismatchError."""
    head_dir = resolve_dir(head_dir, "draft-head checkpoint") if head_dir else Path(DEFAULT_HEAD_DIR)
    cfg, _ = read_head_config(head_dir, target_config)
    if drafter in BIDIRECTIONAL_DRAFTERS and cfg.causal and (bidir_dir(head_dir) / "config.json").is_file():
        head_dir = bidir_dir(head_dir)
        cfg, _ = read_head_config(head_dir, target_config)
    return head_dir, cfg, drafter_for(cfg, drafter)


def load_stack(target_dir=None, head_dir=None, dtype="auto", drafter=None, width=DEFAULT_WIDTH, device="cpu",
               tree="exact", depth=None, lookup=True, exact="off"):
    """(Target, Drafter) ready to generate, with `jetflow generate`'s defaults (tested). drafter=None picks the head's
    kind (causal: jetflow; bidirectional: ddtree). Heads are loaded only for drafters that use them. lookup (default
    on, as the CLI): head drafters also merge prompt-lookup continuations into their greedy trees
    (drafters.WithLookup); drafters without a head ignore it; lookup=False drafts with the head alone.
    exact="on": every verify row rounds as a one-token step does (exact.py; CPU), so greedy output is token-identical
    to plain decoding in bf16 too, for up to about 1.35x the verify cost at 8-16 nodes."""
    from jetflow_sglang.engine import exact as exact_rows
    from jetflow_sglang.engine.profiling import tune_gemm
    from jetflow_sglang.engine.target import Target, target_config

    check_stack_args(drafter, width, device, tree, depth, dtype, exact)
    _check_device_present(device)
    target_dir = resolve_dir(target_dir, "target model folder") if target_dir else Path(default_paths()[0])
    tcfg = target_config(target_dir)
    wanted = cfg = None
    if drafter not in NO_HEAD:
        wanted, cfg, drafter = pick_head(head_dir, drafter, tcfg)
        check_head_files(wanted, tcfg)  # a head for another target or with bad files fails here, before any weights
        if depth is not None and depth > cfg.block_size - 1:
            raise ValueError(f"depth must be an integer in [1, {cfg.block_size - 1}] (the head's block of "
                             f"{cfg.block_size} slots drafts up to {cfg.block_size - 1} levels); got {depth}")
    head = load_head(wanted) if cfg is not None else None  # its weights are checked before the target is loaded
    target = Target.from_pretrained(target_dir, dtype=dtype, device=device)
    exact_rows.setup(target, exact)
    if head is not None:
        head = attach_head(head, target)
        target.tap_layers = list(head.config.tap_layers)
    kw = {"tree": tree, "depth": depth, "lookup": bool(lookup)}
    if drafter in NO_HEAD:
        made = make_drafter(drafter, width=width, **kw)
    elif drafter in BIDIRECTIONAL_DRAFTERS:
        made = make_drafter(drafter, None, head, width=width, **kw)
    else:
        made = make_drafter(drafter, head, None, width=width, **kw)
    tune_gemm(target, made)  # float32 on CPU: W @ X^T only for the shapes and rows where it measured faster here
    return target, made


__all__ = ["DRAFTERS", "TREES", "check_device", "check_stack_args", "load_stack", "pick_head"]
