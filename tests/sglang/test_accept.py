"""The worker's acceptance (accept.accept_batch) on every tree size and on mixed batches, without a server.

A one-node tree (budget 0/1: what `auto` picks at the start of a request, `--speculative-num-draft-tokens 1`, or a
tree shrunk by a tight KV pool) must accept its root and emit one token for greedy and sampled requests alike; in a
batch that mixes greedy and sampled requests each request keeps its own rule."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from jetflow_sglang.sglang.accept import accept_batch, to_sglang
from jetflow_sglang.core.tree_batch import build_topb, root_only

V = 7


def _info(temps, top_ks=None):
    """What accept_batch reads of SGLang's SamplingBatchInfo (temperature 0 arrives as top_k = 1)."""
    temps = torch.tensor(temps, dtype=torch.float32)
    greedy = temps == 0
    top_ks = torch.tensor(top_ks) if top_ks is not None else torch.where(greedy, 1, V).int()
    return SimpleNamespace(is_all_greedy=bool(greedy.all()), temperatures=torch.where(greedy, 1.0, temps)[:, None],
                           top_ks=top_ks, top_ps=torch.ones(len(temps)), min_ps=torch.zeros(len(temps)),
                           need_min_p_sampling=False)


def _trees(b, budget, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(0, V, (b,), generator=g)
    if budget <= 1:
        return root_only(anchor, 1)
    lps = torch.randn(b, 3, 3, generator=g).log_softmax(-1).sort(-1, descending=True).values
    toks = torch.stack([torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(3)]) for _ in range(b)])
    return build_topb(anchor, toks, lps, budget)


@pytest.mark.parametrize("temps", [[1.0], [0.0], [0.7, 0.0, 1.0], [0.0, 0.0], [1.0, 0.5]])
@pytest.mark.parametrize("budget", [1, 2, 8])
def test_every_request_accepts_its_root_and_emits_a_token(temps, budget):
    tree = _trees(len(temps), budget)
    b, n = tree.tokens.shape
    logits = torch.randn(b * n, V, generator=torch.Generator().manual_seed(1))
    path, bonus = accept_batch(tree, logits, _info(temps), width=3, generator=torch.Generator().manual_seed(2))
    assert path.shape == (b, min(tree.depth_bound, n - 1) + 1)
    assert (path[:, 0] == 0).all(), path  # the root is always accepted
    _, accept_index, accept_lens, emitted = to_sglang(tree.tokens, path, bonus, n)
    assert (accept_lens >= 1).all(), accept_lens  # SGLang's accept statistics index accept_lens - 1
    assert ((0 <= bonus) & (bonus < V)).all()
    for i, t in enumerate(temps):
        if t == 0 and n == 1:  # a greedy one-node round is plain decoding: the argmax at the root
            assert int(emitted[i, 0]) == int(logits.view(b, n, V)[i, 0].argmax())


def test_greedy_rows_of_a_mixed_batch_keep_their_greedy_paths():
    """The sampled rows of a batch must not change what its greedy rows accept (they did when the sampled path was
    empty: torch.where broadcast it over the greedy paths)."""
    tree = _trees(4, 8, seed=3)
    b, n = tree.tokens.shape
    logits = torch.randn(b, n, V, generator=torch.Generator().manual_seed(4))
    for i in range(b):  # plant a greedy chain of depth 2 under every root
        kids = [j for j in range(1, n) if int(tree.parents[i, j]) == 0 and j < int(tree.sizes[i])]
        logits[i, 0, int(tree.tokens[i, kids[0]])] = 50.0
    all_greedy, _ = accept_batch(tree, logits.view(b * n, V), _info([0.0] * b), 3)
    for budget_tree in (tree, root_only(tree.tokens[:, 0], 1)):
        nb = budget_tree.tokens.shape[1]
        lg = logits[:, :nb].reshape(b * nb, V)
        ref, ref_bonus = accept_batch(budget_tree, lg, _info([0.0] * b), 3)
        mixed, bonus = accept_batch(budget_tree, lg, _info([0.0, 1.0, 0.0, 0.8]), 3, torch.Generator().manual_seed(5))
        assert torch.equal(mixed[[0, 2]], ref[[0, 2]]) and torch.equal(bonus[[0, 2]], ref_bonus[[0, 2]])
    assert (all_greedy[:, 1] >= 1).all()  # the planted child was accepted


def test_a_sampled_one_node_round_draws_from_the_target():
    """At T > 0 a one-node round emits one token drawn from the processed target distribution at the root."""
    reps = 20000
    tree = root_only(torch.full((reps,), 2), 1)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(6)).expand(reps, V).contiguous()
    path, bonus = accept_batch(tree, logits, _info([0.8] * reps), 3, torch.Generator().manual_seed(7))
    assert (path[:, 0] == 0).all() and path.shape[1] == 1
    p = (logits[0] / 0.8).softmax(-1)
    freq = torch.bincount(bonus, minlength=V).float() / reps
    assert ((freq - p).abs() / (p * (1 - p) / reps).sqrt()).max() < 4.5


def _params(top_k=1 << 30, top_p=1.0, min_p=0.0):
    return SimpleNamespace(top_k=top_k, top_p=top_p, min_p=min_p)


def test_truncation_reads_the_sampled_requests_parameters():
    from jetflow_sglang.sglang.accept import truncation

    vocab, greedy, default = 100, _params(top_k=1), _params()
    assert truncation([greedy, default], vocab) == 0  # the OpenAI defaults: temperature alone, no sort
    assert truncation([greedy, _params(top_k=500)], vocab) == 0  # top_k past the vocabulary truncates nothing
    assert truncation([default, _params(top_k=20), greedy], vocab) == vocab  # one selection for all: the default
    # row keeps every token, so the full sort
    assert truncation([_params(top_k=20, top_p=0.9), _params(top_k=7, min_p=0.1), greedy], vocab) == 20
    assert truncation([_params(top_k=20), _params(top_p=0.8)], vocab) == vocab  # an unbounded top-p: the full sort
    assert truncation([greedy, greedy], vocab) == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_bounded_selection_gives_the_full_sorts_probabilities(seed):
    """processed_probs over each node's top-K (keep = truncation) equals the full sort, for top-k with top-p and
    min-p, greedy rows aside; with no truncating request the tempered softmax alone equals it too."""
    from jetflow_sglang.sglang.accept import processed_probs, truncation

    g = torch.Generator().manual_seed(seed)
    b, n, vocab = 4, 5, 300
    logits = torch.randn(b, n, vocab, generator=g) * 3
    cases = [[_params(top_k=1), _params(top_k=40, top_p=0.8), _params(top_k=12, min_p=0.05), _params(top_k=3)],
             [_params(top_k=1), _params(), _params(), _params(top_k=1)]]
    for params in cases:
        temps = torch.tensor([1.0, 0.7, 1.3, 0.9])[:, None]
        info = SimpleNamespace(temperatures=temps, top_ks=torch.tensor([p.top_k for p in params]),
                               top_ps=torch.tensor([p.top_p for p in params]),
                               min_ps=torch.tensor([p.min_p for p in params]),
                               need_min_p_sampling=any(p.min_p > 0 for p in params))
        keep = truncation(params, vocab)
        assert keep < vocab
        got, want = processed_probs(logits, info, keep), processed_probs(logits, info)
        sampled = torch.tensor([p.top_k != 1 for p in params])
        torch.testing.assert_close(got[sampled], want[sampled], atol=1e-6, rtol=1e-5)
        assert torch.allclose(got.sum(-1), torch.ones(b, n))
