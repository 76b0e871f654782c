"""The captured round pieces (core/graphs.py) on a CPU: the tree build from a real head's output and the acceptance
(greedy and mixed greedy + sampled) replayed from one capture per (batch bucket, budget) give what the eager pieces
give, over 100 rounds whose anchors, contexts, head outputs, target logits and accepted lengths all change; a key is
captured once; padded rows change nothing; a piece that reads device data on the host is refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jetflow_sglang.core.graphs import CaptureError, GraphRunner, batch_bucket
from jetflow_sglang.draft.drafters import HeadDrafter
from jetflow_sglang.sglang.accept import accept_batch
from tests.helpers import tiny_head, tiny_model

torch.set_num_threads(1)
V = 64  # tiny_model's vocabulary


def _head() -> HeadDrafter:
    """A tiny random causal head bound to a tiny random Qwen3 (its output is a real head forward)."""
    head = tiny_head(tiny_model("qwen3", seed=3), seed=4)
    return HeadDrafter(head, mode="tree", width=4, depth=head.config.block_size - 1)


def _info(bs: int, sampled: list[bool], gen) -> SimpleNamespace:
    temps = torch.where(torch.tensor(sampled), torch.rand(bs, generator=gen) + 0.5, torch.ones(bs))
    return SimpleNamespace(is_all_greedy=not any(sampled), temperatures=temps.view(bs, 1),
                           top_ks=torch.tensor([V if s else 1 for s in sampled]), top_ps=torch.full((bs,), 0.95),
                           min_ps=torch.zeros(bs), need_min_p_sampling=False)


def test_round_pieces_replay_as_eager_for_100_rounds():
    drafter, gen = _head(), torch.Generator().manual_seed(3)
    runner = GraphRunner("fx", check=True)  # every replay is also compared with the eager piece, bit for bit
    keys = set()
    for r in range(100):
        bs = (1, 3, 4)[r % 3]
        budget = (8, 16, 64)[r // 34]
        ctx_len = 5 + r  # the context grows every round; the captured pieces never see it
        anchors = torch.randint(0, V, (bs,), generator=gen)
        ctx = drafter.context_kv(torch.randn(bs, ctx_len, drafter.head.fc.in_features, generator=gen), 0)
        lens = torch.full((bs,), ctx_len)
        out = drafter.head_batch(anchors, ctx, lens, budget)
        drafter.runner = None
        eager = drafter.tree_batch(anchors, out, ctx, lens, budget)
        drafter.runner = runner
        tree = drafter.tree_batch(anchors, out, ctx, lens, budget)
        for a, b in zip((tree.tokens, tree.parents, tree.depths, tree.logps, tree.sizes),
                        (eager.tokens, eager.parents, eager.depths, eager.logps, eager.sizes)):
            assert torch.equal(a, b)  # unpadded eager against the padded replay's real rows
        assert tree.max_depth == eager.max_depth
        # target logits that agree with the tree along a random depth, so accepted lengths change every round
        logits = torch.randn(bs * budget, V, generator=gen)
        follow = torch.rand(bs, budget, generator=gen) < 0.7
        child = torch.full((bs, budget), -1)
        for i in range(bs):
            for v in range(1, int(tree.sizes[i])):
                p = int(tree.parents[i, v])
                if child[i, p] < 0:
                    child[i, p] = int(tree.tokens[i, v])
        rows = torch.arange(bs * budget)
        boost = torch.where(follow.view(-1) & (child.view(-1) >= 0), child.view(-1), -1)
        logits[rows[boost >= 0], boost[boost >= 0]] += 50.0
        sampled = [bool(x) for x in torch.rand(bs, generator=gen) < (0.0 if r % 2 else 0.6)]
        info = _info(bs, sampled, gen)
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        want = accept_batch(eager, logits, info, 4, torch.Generator().manual_seed(seed))
        got = accept_batch(tree, logits, info, 4, torch.Generator().manual_seed(seed), runner=runner)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), r
        keys.add((bs, budget, info.is_all_greedy))
    snap = runner.snapshot()
    trees = {(batch_bucket(bs), budget) for bs, budget, _ in keys}
    accepts = {(batch_bucket(bs), budget, greedy) for bs, budget, greedy in keys}
    assert snap["captures"] == len(trees) + len(accepts) and snap["refused"] == 0, snap  # one per key, none again
    assert snap["replays"] == 200


def test_padded_rows_change_nothing():
    """Three requests padded to a bucket of four: their rows equal a batch of three run eagerly, whatever row 0
    (the padding's copy) holds."""
    drafter, gen = _head(), torch.Generator().manual_seed(5)
    drafter.runner = GraphRunner("fx")
    for _ in range(3):
        anchors = torch.randint(0, V, (3,), generator=gen)
        out = torch.randn(3, 15, V, generator=gen).log_softmax(-1)
        got = drafter.tree_batch(anchors, out, None, None, 16)
        assert got.tokens.shape == (3, 16)
        for i in range(3):
            one = drafter.tree_batch(anchors[i:i + 1], out[i:i + 1], None, None, 16)  # a bucket of one
            assert torch.equal(got.tokens[i], one.tokens[0]) and torch.equal(got.parents[i], one.parents[0])


@pytest.mark.parametrize("piece", ["item", "boolean index", "multinomial", "copy from Python data"])
def test_a_piece_that_waits_for_the_device_is_refused(piece):
    fns = {"item": lambda x: (x * int(x.sum()),),
           "boolean index": lambda x: (x[x > 0],),
           "multinomial": lambda x: (torch.multinomial(x.abs() + 0.1, 1),),
           "copy from Python data": lambda x: (x + torch.tensor([[1.0, 2.0, 3.0]]),)}
    with pytest.raises(CaptureError):
        GraphRunner("fx", check=True).run("bad", (), fns[piece], torch.randn(2, 3))
    served = GraphRunner("fx")  # a server's runner logs it and runs that shape eagerly
    x = torch.randn(2, 3)
    assert [torch.equal(a, b) for a, b in zip(served.run("bad", (), fns[piece], x), fns[piece](x))] == [True] \
        or piece == "multinomial"
    assert served.snapshot()["refused"] == 1 and served.snapshot()["captures"] == 0


def test_check_mode_catches_a_key_that_misses_what_the_piece_reads():
    """A piece closing over a value its key does not name replays its first capture: check mode says so."""
    runner, scale = GraphRunner("fx", check=True), [1.0]
    piece = lambda x: (x * scale[0],)  # noqa: E731
    runner.run("scaled", (), piece, torch.ones(2, 2))
    scale[0] = 2.0
    with pytest.raises(CaptureError, match="differs"):
        runner.run("scaled", (), piece, torch.ones(2, 2))


def test_eager_backend_runs_the_piece():
    got = GraphRunner("eager").run("id", (), lambda x: (x + 1,), torch.zeros(3, 2))
    assert torch.equal(got[0], torch.ones(3, 2))
