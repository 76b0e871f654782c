"""tp_sync on a real 2-process gloo group (no SGLang server): rank 0's values win, in place, for contiguous,
non-contiguous and bool tensors; generators follow --random-seed and never touch the global RNG."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jetflow_sglang.sglang import tp_sync


class _Group:  # the two GroupCoordinator members tp_sync uses
    def __init__(self, rank, world):
        self.rank_in_group, self.world_size = rank, world

    def broadcast(self, t, src=0):
        dist.broadcast(t, src=src)
        return t

    def broadcast_object(self, obj=None, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tp_sync._group = lambda: _Group(rank, 2)
    a = torch.full((3,), float(rank))
    b = torch.arange(6).view(2, 3).t() * (rank + 1)  # non-contiguous
    c = torch.tensor([rank == 0, rank == 1])
    tp_sync.broadcast_from_rank0([a, b, c])
    obj = tp_sync.broadcast_object_from_rank0({"budget": 5 + rank})
    out[rank] = (a.tolist(), b.tolist(), c.tolist(), obj, tp_sync.rank(), tp_sync.world_size())
    dist.destroy_process_group()


def test_broadcast_from_rank0_on_two_gloo_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
    want_b = (torch.arange(6).view(2, 3).t()).tolist()
    for rank in (0, 1):
        a, b, c, obj, r, w = out[rank]
        assert a == [0.0, 0.0, 0.0] and b == want_b and c == [True, False] and obj == {"budget": 5}
        assert (r, w) == (rank, 2)


def test_single_process_is_a_no_op():
    t = torch.tensor([1, 2])
    tp_sync.broadcast_from_rank0([t])
    assert t.tolist() == [1, 2] and tp_sync.world_size() == 1 and tp_sync.is_rank0()


def test_generators_follow_the_seed_without_touching_global_rng():
    state = torch.get_rng_state()
    sa = SimpleNamespace(random_seed=1234)
    g1, g2 = tp_sync.make_generator(sa, "cpu"), tp_sync.make_generator(sa, "cpu")
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))
    assert not torch.equal(torch.rand(4, generator=tp_sync.make_generator(sa, "cpu", offset=1)),
                           torch.rand(4, generator=tp_sync.make_generator(sa, "cpu")))
    assert torch.equal(torch.get_rng_state(), state)
