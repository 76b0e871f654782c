"""Identical speculative decisions on every tensor-parallel rank, as SGLang's own spec_tp_sync.py does for DFLASH:
rank 0 decides (tree, budget, accepted path, bonus token) and broadcasts; the other ranks adopt rank 0's values.

Randomness: `make_generator` seeds a private torch.Generator from SGLang's resolved `--random-seed` (the same on
every rank, since all ranks get the same ServerArgs record), so seeded draws line up across ranks and across runs.
Nothing here calls torch.seed() or reseeds a global RNG.
"""
from __future__ import annotations

import torch

SEED_MASK = (1 << 63) - 1


def _group():
    """The TP group that runs this DP rank's batch (SGLang's get_dp_tp_group), or None outside a distributed run."""
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group

        return get_dp_tp_group()
    except (ImportError, AttributeError, AssertionError, ValueError, RuntimeError):
        return None


def world_size() -> int:
    g = _group()
    return 1 if g is None else int(g.world_size)


def rank() -> int:
    g = _group()
    return 0 if g is None else int(g.rank_in_group)


def is_rank0() -> bool:
    return rank() == 0


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite each tensor in place with rank 0's values (same shapes and dtypes on every rank). No-op at tp=1.
    Non-contiguous tensors travel through a contiguous copy; bool tensors travel as uint8 (gloo has no bool)."""
    g = _group()
    if g is None or int(g.world_size) == 1:
        return
    for t in tensors:
        buf = t if t.is_contiguous() else t.contiguous()
        g.broadcast(buf.view(torch.uint8) if buf.dtype == torch.bool else buf, src=0)
        if buf is not t:
            t.copy_(buf)


def broadcast_object_from_rank0(obj):
    """Rank 0's picklable object on every rank (for small host-side decisions); returns `obj` itself at tp=1."""
    g = _group()
    if g is None or int(g.world_size) == 1:
        return obj
    return g.broadcast_object(obj, src=0)


def resolved_random_seed(server_args) -> int:
    """SGLang's resolved --random-seed (the launcher draws one when the flag is absent; children inherit it)."""
    seed = None
    try:
        from sglang.srt.arg_groups.overrides import resolving_view

        seed = resolving_view(server_args).random_seed
    except (ImportError, AttributeError, TypeError):
        seed = getattr(server_args, "random_seed", None)
    return int(seed) if seed is not None else 0


def make_generator(server_args, device, offset: int = 0) -> torch.Generator:
    """A private generator on `device` seeded from --random-seed (+ `offset`, e.g. a per-purpose salt)."""
    g = torch.Generator(device=device)
    g.manual_seed((resolved_random_seed(server_args) + int(offset)) & SEED_MASK)
    return g
