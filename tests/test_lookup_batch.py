"""lookup_batch.merge_lookup (the device form of WithLookup's merge) against the host reference: the same nodes, in
the same order, with the same scores as tree.merge([head tree, NgramDrafter trie]) for every request of a batch."""
from __future__ import annotations

import random

import pytest
import torch

from jetflow_sglang.draft.drafters import NgramDrafter, State
from jetflow_sglang.core.lookup_batch import merge_lookup
from jetflow_sglang.core.tree import merge
from jetflow_sglang.core.tree_batch import build_topb


def _case(rng: random.Random, b: int, vocab: int, depth: int, width: int, budget: int, ties: bool):
    """Head trees over random per-depth candidates, and ragged repetitive histories."""
    anchors = torch.tensor([rng.randrange(vocab) for _ in range(b)])
    toks = torch.stack([torch.stack([torch.randperm(vocab)[:width] for _ in range(depth)]) for _ in range(b)])
    if ties:  # head log-probs on the lookup's own grid (-1/n steps): equal scores across the two trees
        grid = [-1.0, -0.5, -1 / 3, -0.25, -0.75, -2.0]
        lps = torch.tensor([[sorted((rng.choice(grid) for _ in range(width)), reverse=True) for _ in range(depth)]
                            for _ in range(b)])
    else:
        lps = torch.round(-(torch.rand(b, depth, width) * 3).sort(-1).values * 1024) / 1024
    tree = build_topb(anchors, toks, lps.float(), budget)
    hist = []
    for _ in range(b):
        h = [rng.randrange(vocab) for _ in range(rng.randint(0, 80))]
        for _ in range(rng.randint(0, 3)):  # copy some spans so that long n-grams recur
            if len(h) > 8:
                i, j = sorted(rng.sample(range(len(h)), 2))
                h += h[i:j]
        hist.append(h)
    width_l = max([len(h) for h in hist] + [1]) + rng.randint(0, 3)
    seq = torch.full((b, width_l), rng.randrange(vocab), dtype=torch.long)  # padding that may look like tokens
    for i, h in enumerate(hist):
        seq[i, :len(h)] = torch.tensor(h, dtype=torch.long)
    return tree, seq, torch.tensor([len(h) for h in hist]), hist


@pytest.mark.parametrize("seed", range(12))
def test_merge_lookup_equals_the_host_merge(seed):
    rng = random.Random(seed)
    checked = merged = 0
    for _ in range(25):
        vocab = rng.choice([3, 4, 6, 30])
        width = rng.randint(1, min(vocab, 8))
        budget = rng.choice([2, 3, 5, 8, 16, 33, 64, 128, 256])
        ng = NgramDrafter(n_max=rng.choice([1, 2, 4]), max_depth=rng.choice([3, 7, 15]),
                          max_matches=rng.choice([1, 4, 8]))
        ng.n_min = rng.randint(1, ng.n_max)
        tree, seq, lens, hist = _case(rng, rng.randint(1, 5), vocab, rng.randint(1, 15), width, budget,
                                      ties=rng.random() < 0.5)
        got = merge_lookup(tree, seq, lens, budget, ng.n_max, ng.n_min, ng.max_depth, ng.max_matches)
        assert got.tokens.shape == (tree.batch, budget)
        for i, h in enumerate(hist):
            head = tree.tree(i)
            ref = merge([head, ng.draft(State(tokens=h), head.tokens[0], budget)], budget)
            out = got.tree(i)
            assert (out.tokens, out.parents, out.depths) == (ref.tokens, ref.parents, ref.depths)
            assert out.logps == pytest.approx(ref.logps, abs=1e-6)
            assert got.depth_bound >= max(out.depths)
            checked += 1
            merged += out.tokens != head.tokens
    assert checked > 25 and merged > 5  # the tries changed many trees


def test_merge_lookup_budget_one_and_empty_history():
    tree = build_topb(torch.tensor([3, 4]), torch.tensor([[[1, 2]], [[2, 1]]]), -torch.rand(2, 1, 2).sort(-1).values, 4)
    one = merge_lookup(tree, torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 0]), 1)
    assert one.tokens.tolist() == [[3], [4]] and one.sizes.tolist() == [1, 1]
    same = merge_lookup(tree, torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 0]), 4)  # nothing to look up
    assert torch.equal(same.tokens, tree.tokens) and torch.equal(same.parents, tree.parents)
