import json

import pytest
import torch

from jetflow_sglang.head import MASK, CheckpointError, HeadMismatchError, load_head, save_head
from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.core.tree_batch import build_topb
from tests.helpers import tiny_head, tiny_model, tiny_target

torch.set_num_threads(1)


def block_logits(head, tokens, n_ctx=12):
    taps = torch.randn(1, n_ctx, len(head.config.tap_layers) * head.config.hidden_size, generator=torch.Generator().manual_seed(0))
    kv = head.context_kv(taps, torch.arange(n_ctx)[None])
    t = torch.tensor([tokens])
    pos = torch.arange(n_ctx, n_ctx + len(tokens))[None]
    return head.logits(head(t, pos, kv, head.block_mask(n_ctx, len(tokens))[None]))[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_causal_slots_ignore_later_slots_bidirectional_do_not(family):
    model = tiny_model(family)
    base = [5] + [MASK] * 15
    changed = [5] + [MASK] * 9 + [17] + [MASK] * 5  # slot 10 now holds a real token
    causal, bidir = tiny_head(model, causal=True), tiny_head(model, causal=False)
    with torch.no_grad():
        a, b = block_logits(causal, base), block_logits(causal, changed)
        assert torch.equal(a[:10], b[:10]), "a causal slot must not see later slots"
        assert not torch.allclose(a[10:], b[10:])
        a, b = block_logits(bidir, base), block_logits(bidir, changed)
        assert not torch.allclose(a[:10], b[:10]), "bidirectional slots see every slot"


def test_save_load_round_trip_and_drafts(tmp_path):
    model = tiny_model("qwen3")
    head = tiny_head(model, draft_vocab_size=40)
    save_head(head, tmp_path / "h", dtype=torch.float32)
    loaded = load_head(tmp_path / "h", model)
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    target = tiny_target("qwen3")
    target.model = model
    logits, taps = target.prefill([1, 2, 3, 4])
    drafter = make_drafter("jetflow", loaded)
    tree = drafter.draft(drafter.new_state([1, 2, 3, 4], taps), 9, budget=16)
    assert len(tree) == 16 and all(t in set(loaded.vocab_ids.tolist()) for t in tree.tokens[1:])


def test_bad_checkpoints(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(CheckpointError, match="no draft-head checkpoint"):
        load_head(tmp_path / "missing", model)
    save_head(tiny_head(model), tmp_path / "h")
    # a head for another target: different vocab
    with pytest.raises(HeadMismatchError, match="vocab_size"):
        load_head(tmp_path / "h", tiny_model("llama", vocab=80))
    with pytest.raises(HeadMismatchError, match="architecture"):
        load_head(tmp_path / "h", tiny_model("qwen3"))
    # truncated weights
    w = tmp_path / "h" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_head(tmp_path / "h", model)
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_head(tmp_path / "h", model)
    (tmp_path / "h" / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(CheckpointError):
        load_head(tmp_path / "h", model)


@pytest.mark.parametrize("causal", [True, False])
def test_small_budgets_run_a_shorter_block_with_the_same_draft(causal):
    """A causal head drafts a B-node tree from [anchor, MASK x (B-1)]: the same log-probs as the full block's first
    B-1 levels, hence the same trees. A bidirectional block always runs whole."""
    model = tiny_model("qwen3")
    head = tiny_head(model, causal=causal, draft_vocab_size=48)
    drafter = make_drafter("jetflow" if causal else "ddtree", head if causal else None, None if causal else head)
    taps = torch.randn(2, 9, len(head.config.tap_layers) * head.config.hidden_size,
                       generator=torch.Generator().manual_seed(3))
    ctx_kv, lens = drafter.context_kv(taps, 0), torch.tensor([9, 6])
    full = drafter.block_logprobs_batch([4, 7], ctx_kv, lens)
    for budget in (2, 3, 5, 9, 16, 40):
        d = drafter.levels(budget)
        assert d == min(budget - 1, 15)
        short = drafter.block_logprobs_batch([4, 7], ctx_kv, lens, d)
        assert short.shape[1] == d
        torch.testing.assert_close(short, full[:, :d], atol=1e-5, rtol=1e-5)
        got = drafter.draft_batch([4, 7], ctx_kv, lens, budget)
        want = build_topb(torch.tensor([4, 7]), *drafter._topk(full), budget)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)



@pytest.mark.parametrize("name,tree", [("jetflow", "exact"), ("jetflow", "paper"), ("jetflow-branch", "exact"),
                                       ("jetflow-branch", "paper")])
def test_a_drafting_horizon_gives_the_full_block_tree(name, tree, monkeypatch):
    """`draft` runs only the levels a request's last tree reached (+ a margin) and redrafts with every level when the
    tree reaches the last one: every tree equals the full block's, whatever horizon it started from."""
    model = tiny_model("llama")
    head = tiny_head(model, draft_vocab_size=48)
    drafter = make_drafter(name, head, None, width=3, tree=tree)
    runs = []
    real = drafter.block_logprobs_batch
    monkeypatch.setattr(drafter, "block_logprobs_batch", lambda *a, **k: runs.append(a[3]) or real(*a, **k))
    gen = torch.Generator().manual_seed(5)
    outcomes = set()
    for case in range(12):
        n = 4 + case
        taps = torch.randn(n, len(head.config.tap_layers) * head.config.hidden_size, generator=gen)
        prompt = torch.randint(0, 64, (n,), generator=gen).tolist()
        for budget in (3, 8, 24, 40):
            full = drafter.levels(budget)
            want = drafter.draft(drafter.new_state(prompt, taps), prompt[-1], budget)  # a new state runs every level
            for start in sorted({1, 2, 3, full}):
                state = drafter.new_state(prompt, taps)
                state.extra["horizon"] = {budget: start}
                runs.clear()
                got = drafter.draft(state, prompt[-1], budget)
                assert (got.tokens, got.parents) == (want.tokens, want.parents), (case, budget, start)
                reached = max(got.depths)
                assert state.extra["horizon"][budget] == reached + 2  # the next tree's levels
                first = min(start, full)
                assert runs == ([first, full] if first < full and reached >= first else [first])
                outcomes.add((first < full, reached >= first))
    assert {(True, True), (True, False)} <= outcomes  # both a redraft and a kept short tree were exercised

def test_logits_of_a_block_slice_match_a_fresh_tensor():
    """[:, 1:] of a block keeps its outer stride; logits() must give the same values through its 2-D GEMM."""
    model = tiny_model("llama")
    head = tiny_head(model, draft_vocab_size=40)
    hidden = torch.randn(3, 16, head.config.hidden_size)
    w = head.lm_weight()
    got = head.logits(hidden[:, 1:6], w)
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got, torch.einsum("bsd,vd->bsv", hidden[:, 1:6], w))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_weights_give_the_same_context_kv_and_block(family):
    """Drafters project the context rows of every layer with one stacked GEMM (qk-norm per layer for Qwen3), and a
    block's q|k|v and gate|up with one GEMM each per layer: the same numbers as the separate projections."""
    model = tiny_model(family)
    head = tiny_head(model)
    taps = torch.randn(2, 7, len(head.config.tap_layers) * head.config.hidden_size,
                       generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0], [5]]) + torch.arange(7)
    want = head.context_kv(taps, pos)
    got = head.context_kv(taps, pos, head.fused_kv_weight())
    assert len(got) == len(want) == head.config.num_layers
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.shape == wk.shape and gv.shape == wv.shape
        torch.testing.assert_close(gk, wk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv, wv, atol=1e-5, rtol=1e-5)
    tokens = torch.tensor([[3] + [MASK] * 5, [9] + [MASK] * 5])
    bpos = torch.tensor([[7], [12]]) + torch.arange(6)
    mask = torch.ones(2, 6, 7 + 6, dtype=torch.bool)
    mask[:, :, 7:] = head.block_mask(0, 6)
    fused = [layer.fused_weights() for layer in head.layers]
    torch.testing.assert_close(head(tokens, bpos, got, mask, fused), head(tokens, bpos, want, mask),
                               atol=1e-5, rtol=1e-5)
