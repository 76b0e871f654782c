"""The vectorized builder must pick the same trees as the reference best_first(eager=False), tie rule included."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from jetflow_sglang.core.tree import DraftTree, ancestor_mask, best_first, pack_bits, per_depth
from jetflow_sglang.core.tree_batch import TreeBatch, build_topb, build_topb_conditioned
from jetflow_sglang.core.verify import greedy_accept, greedy_accept_batch

torch.set_num_threads(1)


def quantized_cands(rng, b, depth, width, vocab=60, levels=6):
    """Log-probs on a coarse grid (multiples of 1/8): sums are exact in float32 and ties are frequent."""
    toks = torch.stack([torch.stack([torch.randperm(vocab, generator=rng)[:width] for _ in range(depth)])
                        for _ in range(b)])
    lps = -(torch.randint(0, levels * 8, (b, depth, width), generator=rng).float() / 8)
    lps = lps.sort(-1, descending=True).values
    return toks, lps


def node_set(tree: DraftTree):
    """Nodes as token paths with their scores: independent of node order."""
    return sorted((tuple(tree.tokens[i] for i in tree.path_to(v)), round(tree.logps[v], 6)) for v in range(len(tree)))


def check_structure(tb: TreeBatch):
    b, n = tb.tokens.shape
    for i in range(b):
        m = int(tb.sizes[i])
        assert tb.parents[i, 0] == -1 and tb.depths[i, 0] == 0 and tb.logps[i, 0] == 0
        for v in range(1, n):
            p = int(tb.parents[i, v])
            if v < m:
                assert 0 <= p < v and tb.depths[i, v] == tb.depths[i, p] + 1
                assert tb.logps[i, v] <= tb.logps[i, v - 1]  # best-first order
            else:  # padding convention
                assert (p, int(tb.depths[i, v]), int(tb.tokens[i, v])) == (0, 1, int(tb.tokens[i, 0]))
                assert tb.logps[i, v] == float("-inf")


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 4), budget=st.integers(1, 300), width=st.integers(1, 8),
       depth=st.integers(1, 15), levels=st.sampled_from([1, 2, 6, 40]))
def test_build_topb_matches_reference(seed, b, budget, width, depth, levels):
    rng = torch.Generator().manual_seed(seed)
    toks, lps = quantized_cands(rng, b, depth, width, levels=levels)
    anchor = torch.randint(0, 60, (b,), generator=rng)
    tb = build_topb(anchor, toks, lps, budget)
    check_structure(tb)
    assert tb.tokens.shape == (b, budget)
    for i in range(b):
        ref = best_first(int(anchor[i]), per_depth(toks[i].tolist(), lps[i].tolist()), budget, width, depth, eager=False)
        got = tb.tree(i)
        assert node_set(got) == node_set(ref)
        assert got.tokens == ref.tokens and got.parents == ref.parents  # same tie rule, same best-first order
        capacity = sum(width ** d for d in range(depth + 1))
        assert len(got) == min(budget, capacity)  # budget beyond the available nodes: every node, then padding


def test_continuous_scores_are_the_top_paths():
    rng = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 100, (3, 15, 8), generator=rng)
    lps = (-torch.rand(3, 15, 8, generator=rng).pow(2) * 5).sort(-1, descending=True).values
    tb = build_topb(torch.tensor([1, 2, 3]), toks, lps, 256)
    for i in range(3):
        ref = best_first(i + 1, per_depth(toks[i].tolist(), lps[i].tolist()), 256, 8, 15, eager=False)
        assert sorted(tb.tree(i).logps) == pytest.approx(sorted(ref.logps), abs=1e-4)


def test_minus_inf_candidates_are_never_nodes():
    toks = torch.arange(6).view(1, 2, 3)
    lps = torch.tensor([[[0.0, -1.0, float("-inf")], [-0.5, float("-inf"), float("-inf")]]])
    tb = build_topb(torch.tensor([9]), toks, lps, 10)
    ref = best_first(9, per_depth(toks[0].tolist(), lps[0].tolist()), 10, 3, 2)
    assert int(tb.sizes[0]) == len(ref) == 5
    assert node_set(tb.tree(0)) == node_set(ref)


def test_masks_match_the_host_masks():
    rng = torch.Generator().manual_seed(4)
    toks, lps = quantized_cands(rng, 3, 15, 8)
    tb = build_topb(torch.tensor([5, 6, 7]), toks, lps, 77)
    anc, packed = tb.ancestor_mask(), tb.packed_mask()
    for i in range(3):
        m = int(tb.sizes[i])
        host = tb.tree(i)
        assert torch.equal(anc[i, :m, :m], ancestor_mask(host.parents))
        assert torch.equal(packed[i, :m], pack_bits(ancestor_mask(host.parents), packed.shape[-1]) if m else packed[i, :m])
        for v in range(m, 77):  # padding rows see the root and themselves
            assert anc[i, v].nonzero().flatten().tolist() == [0, v]


def test_from_trees_round_trip():
    trees = [best_first(3, per_depth([[1, 2]] * 3, [[-0.1, -0.7]] * 3), n, 2, 3) for n in (1, 5, 12)]
    tb = TreeBatch.from_trees(trees, budget=16)
    assert tb.sizes.tolist() == [1, 5, 12]
    for i, t in enumerate(trees):
        assert tb.tree(i).tokens == t.tokens and tb.tree(i).parents == t.parents


def conditioned_reference(anchor, first: DraftTree, c_toks, c_lps, toks, lps, budget, width, depth):
    """The host rebuild of jetflow-branch (known token paths take their conditioned children)."""
    known = {tuple(first.tokens[i] for i in first.path_to(v)[1:]): v for v in range(len(first))}

    def child_fn(t, node):
        v = known.get(tuple(t.tokens[i] for i in t.path_to(node)[1:]))
        if v is not None:
            return c_toks[v], c_lps[v]
        return toks[t.depths[node]], lps[t.depths[node]]
    return best_first(anchor, child_fn, budget, width, depth, eager=False)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 3), budget1=st.integers(1, 64), budget=st.integers(1, 128),
       width=st.integers(1, 6), depth=st.integers(1, 8))
def test_build_topb_conditioned_matches_reference(seed, b, budget1, budget, width, depth):
    rng = torch.Generator().manual_seed(seed)
    vocab = max(width, 8)  # a small vocab: conditioned children often repeat pass-1 tokens
    toks, lps = quantized_cands(rng, b, depth, width, vocab=vocab)
    anchor = torch.randint(0, vocab, (b,), generator=rng)
    first = build_topb(anchor, toks, lps, budget1)
    c_toks, c_lps = quantized_cands(rng, b, budget1, width, vocab=vocab)
    tb = build_topb_conditioned(first, c_toks, c_lps, toks, lps, budget)
    check_structure(tb)
    for i in range(b):
        ref = conditioned_reference(int(anchor[i]), first.tree(i), c_toks[i].tolist(), c_lps[i].tolist(),
                                    toks[i].tolist(), lps[i].tolist(), budget, width, depth)
        got = tb.tree(i)
        assert got.tokens == ref.tokens and got.parents == ref.parents


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 4), budget=st.integers(1, 100), width=st.integers(1, 4))
def test_greedy_accept_batch_matches_host(seed, b, budget, width):
    rng = torch.Generator().manual_seed(seed)
    toks, lps = quantized_cands(rng, b, 6, width, vocab=6)
    tb = build_topb(torch.randint(0, 6, (b,), generator=rng), toks, lps, budget)
    argmax = torch.randint(0, 6, (b, budget), generator=rng)
    index, length, bonus = greedy_accept_batch(tb, argmax)
    assert index.shape == (b, min(tb.depth_bound, budget - 1) + 1)
    for i in range(b):
        tree = tb.tree(i)
        path, want = greedy_accept(tree, argmax[i, :len(tree)].tolist())
        assert int(length[i]) == len(path) and int(bonus[i]) == want
        assert index[i].tolist() == path + [-1] * (index.shape[1] - len(path))


def test_greedy_accept_batch_ignores_padding():
    tb = TreeBatch.from_trees([DraftTree.root(4)], budget=4)  # padding slots carry the root token 4
    index, length, bonus = greedy_accept_batch(tb, torch.tensor([[4, 4, 4, 4]]))
    assert length.tolist() == [1] and bonus.tolist() == [4] and index[0, 0] == 0
