"""The server's paged head context (sglang/head_pool.PagedContext: the block's queries attend to the pool's rows in
place through the Triton tree kernel, run here by its interpreter) against the padded one (the rows gathered, one
dense attention): the same draft log-probs for causal and bidirectional heads, ragged contexts, shuffled slots, and
every block size; the block's own K/V lands in the reserved slots only."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: must precede the kernel module's import

import pytest
import torch

triton = pytest.importorskip("triton")

import jetflow_sglang.kernels.triton_tree_attn as tta  # noqa: E402
from jetflow_sglang.core.graphs import GraphRunner  # noqa: E402
from jetflow_sglang.draft.drafters import HeadDrafter  # noqa: E402
from jetflow_sglang.draft.paged import PagedContext  # noqa: E402
from jetflow_sglang.sglang.head_pool import HeadKVPool  # noqa: E402
from tests.helpers import tiny_head, tiny_model  # noqa: E402

if isinstance(tta._tree_attn_fwd, triton.runtime.jit.JITFunction):
    pytest.skip("the Triton kernel module was imported without TRITON_INTERPRET=1 earlier in this process",
                allow_module_level=True)
torch.set_num_threads(1)


def _batch(head, seed, lens, width=96, pool_rows=512):
    """A pool with random context rows, req_to_token rows of shuffled slots (row 0 of the pool: padding)."""
    g = torch.Generator().manual_seed(seed)
    pool = HeadKVPool(head, pool_rows, "cpu")
    taps = torch.randn(pool_rows, head.fc.in_features, generator=g)
    pool.write(torch.arange(1, pool_rows), taps[1:], torch.randint(0, 64, (pool_rows - 1,), generator=g))
    b = len(lens)
    req_to_token = torch.zeros(b + 2, width, dtype=torch.int32)
    perm = torch.randperm(pool_rows - 1, generator=g)[: b * width] + 1
    req_to_token[2:] = perm.view(b, width).to(torch.int32)
    req_pool_indices = torch.arange(2, b + 2)  # rows 0-1 belong to nobody in this batch
    anchors = torch.randint(0, 64, (b,), generator=g)
    return pool, req_to_token, req_pool_indices, torch.tensor(lens), anchors


@pytest.mark.parametrize("causal,budget", [(True, 16), (True, 5), (True, 2), (False, 16)])
def test_paged_context_drafts_what_the_padded_one_drafts(causal, budget):
    model = tiny_model("qwen3", seed=3)
    head = tiny_head(model, causal=causal, seed=4)
    drafter = HeadDrafter(head, mode="tree", width=4, depth=head.config.block_size - 1)
    lens = [7, 40, 1, 63]
    pool, r2t, rpi, ctx_lens, anchors = _batch(head, 11, lens)
    rows = drafter.block_rows(budget)
    assert rows <= budget or not causal
    padded = pool.context(r2t, rpi, ctx_lens, max(lens), rows, paged=False)
    want = drafter.head_batch(anchors, padded, ctx_lens, budget)
    before = [k.clone() for k in pool.k]
    paged = pool.context(r2t, rpi, ctx_lens, max(lens), rows, paged=True)
    assert isinstance(paged, PagedContext) and len(paged) == head.config.num_layers
    got = drafter.head_batch(anchors, paged, ctx_lens, budget)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # only the slots reserved past each request changed (the block rows), never a context row
    reserved = {int(r2t[rpi[i], lens[i] + j]) for i in range(len(lens)) for j in range(rows)}
    for old, new in zip(before, pool.k):
        changed = set((old != new).any(-1).any(-1).nonzero().view(-1).tolist())
        assert changed and changed <= reserved
    # the padded view of a paged context is the padded context
    for (k1, v1), (k2, v2) in zip(paged.padded(), padded):
        torch.testing.assert_close(k1[:, :, : max(lens)], k2)


def test_a_block_larger_than_the_reservation_is_refused():
    model = tiny_model("qwen3", seed=3)
    head = tiny_head(model, seed=4)
    drafter = HeadDrafter(head, mode="tree", width=4, depth=head.config.block_size - 1)
    pool, r2t, rpi, ctx_lens, anchors = _batch(head, 12, [5, 9])
    paged = pool.context(r2t, rpi, ctx_lens, 9, 3, paged=True)  # room for 3 rows, a 16-node tree needs 16
    with pytest.raises(ValueError, match="does not fit"):
        drafter.head_batch(anchors, paged, ctx_lens, 16)


def test_the_captured_head_replays_as_eager_while_contexts_grow():
    """The head forward over a paged context replayed from its capture (core/graphs.py, the CPU back end, check mode:
    every replay is also compared with the eager forward, bit for bit) over rounds whose batch size, budget, anchors
    and context lengths change, with the accepted rows committed to the pool between rounds as the worker's commit
    does: one capture per (budget, batch bucket), the padded context's log-probs, and a padded row (a batch of 3 in
    the bucket of 4) writes its block to slot 0 (padding) only."""
    model = tiny_model("qwen3", seed=3)
    head = tiny_head(model, seed=4)
    drafter = HeadDrafter(head, mode="tree", width=4, depth=head.config.block_size - 1)
    pool, r2t, rpi, lens, _ = _batch(head, 13, [3, 20, 1, 9])
    drafter.runner = runner = GraphRunner("fx", check=True)
    g = torch.Generator().manual_seed(5)
    for r in range(6):  # keys (8, bucket 1), (16, 4), (8, 4), (16, 1), (8, 4), (16, 4): the bucket-4 ones replay again
        bs, budget = (1, 3, 4)[r % 3], (8, 16)[r % 2]
        anchors, ctx_lens = torch.randint(0, 64, (bs,), generator=g), lens[:bs].clone()
        rows = drafter.block_rows(budget)
        before = [k.clone() for k in pool.k]
        paged = pool.context(r2t, rpi[:bs], ctx_lens, int(ctx_lens.max()), rows, paged=True)
        got = drafter.head_batch(anchors, paged, ctx_lens, budget)
        reserved = {int(r2t[rpi[i], ctx_lens[i] + j]) for i in range(bs) for j in range(rows)}
        for old, new in zip(before, pool.k):
            assert set((old != new).any(-1).any(-1).nonzero().view(-1).tolist()) <= reserved | {0}
        drafter.runner = None
        want = drafter.head_batch(anchors, pool.context(r2t, rpi[:bs], ctx_lens, int(ctx_lens.max()), rows,
                                                        paged=False), ctx_lens, budget)
        drafter.runner = runner
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        n = torch.randint(1, 4, (bs,), generator=g)  # accepted rows become context at the next slots
        for i in range(bs):
            slots = r2t[rpi[i], int(ctx_lens[i]): int(ctx_lens[i] + n[i])]
            pool.write(slots, torch.randn(len(slots), head.fc.in_features, generator=g),
                       torch.arange(int(ctx_lens[i]), int(ctx_lens[i] + n[i])))
        lens[:bs] += n
    snap = runner.snapshot()
    assert snap["captures"] == 4 and snap["replays"] == 6 and snap["refused"] == 0, snap  # (8|16) x buckets 1, 4
    assert all(k.startswith("head ") for k in snap["keys"]), snap


@pytest.mark.parametrize("causal,budget,temperature", [(True, 16, 0.0), (False, 8, 0.9)])
def test_the_engine_drafts_over_a_paged_context_and_replays_its_head(causal, budget, temperature):
    """`jetflow generate --graphs` on a GPU (here the Triton interpreter): the engine's drafter reads its context as a
    paged pool over its own storage (ContextKV.paged), so the head forward replays from a capture per (budget,
    depth, storage); greedy output is the target's own greedy decoding, the drafts (per-round tree sizes and
    accepted paths, greedy and sampled with one seed) are those of the padded context, and the storage's growth
    starts a new capture. (Replay against eager, bit for bit, is the check-mode test above.)"""
    from jetflow_sglang.engine.loop import autoregressive, run
    from jetflow_sglang.engine.target import Target

    model = tiny_model("qwen3", seed=3)
    target = Target(model)
    head = tiny_head(model, causal=causal, seed=4)
    prompt = [(7 * i + 3) % 64 for i in range(40)]  # a store of 80 rows, which the last rounds' blocks outgrow
    kw = dict(max_new_tokens=30, budget=budget, temperature=temperature, seed=7)
    drafter = HeadDrafter(head, mode="tree", width=4, depth=head.config.block_size - 1)
    want = run(target, drafter, prompt, **kw)
    drafter.paged, drafter.runner = True, GraphRunner("fx")
    got = run(target, drafter, prompt, **kw)
    assert got.tokens == want.tokens
    assert [(len(r.tree), r.path) for r in got.rounds[1:]] == [(len(r.tree), r.path) for r in want.rounds[1:]]
    if temperature == 0:
        assert got.tokens == autoregressive(target, prompt, max_new_tokens=30).tokens
    snap = drafter.runner.snapshot()
    heads = [k for k in snap["keys"] if k.startswith("head ")]
    assert snap["refused"] == 0 and len({k.split("pool")[1] for k in heads}) >= 2, snap  # grown: a new capture
    assert snap["replays"] >= len(got.rounds) - 1 > len(heads), snap
