"""Data-parallel plumbing for head training: `torchrun --nproc-per-node N scripts/train_head.py ...`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT); `DistInfo.from_env` reads them once.
Without them (a plain `python scripts/train_head.py`) everything here is a no-op for one process.
gloo on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK).

Data sharding: rank r owns the records whose position in the (file-order) record list is r modulo the world size;
it builds and loads only those teacher features. The split depends only on the world size, so a run can resume with
another one (its checkpoint holds no per-rank state).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DistInfo":
        env = os.environ if env is None else env
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as e:
            raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad torchrun environment: RANK={rank}, WORLD_SIZE={world}")
        return cls(rank, world, local)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def device(self, requested: str) -> str:
        """cuda -> cuda:LOCAL_RANK when distributed; an explicit cuda:N or cpu is kept."""
        if self.distributed and requested == "cuda":
            return f"cuda:{self.local_rank}"
        return requested


def init(info: DistInfo, device: str) -> None:
    """Join the process group (gloo on CPU, nccl on CUDA); nothing to do for one process."""
    if not info.distributed or dist.is_initialized():
        return
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", rank=info.rank, world_size=info.world)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum or max) when a process group with >1 rank exists; returns `t`."""
    if active():
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
        x = t.to(dev)  # nccl reduces CUDA tensors only
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        if x is not t:
            t.copy_(x)
    return t


def barrier() -> None:
    if active():
        dist.barrier()


def shard(items: list, rank: int, world: int) -> list:
    """This rank's share of `items` (every world-th item, starting at `rank`)."""
    return items[rank::world]
