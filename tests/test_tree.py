import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from jetflow_sglang.core.tree import (DraftTree, ancestor_mask, best_first, chain, check_budget, merge, pack_bits, pack_ragged,
                                 per_depth, unpack_bits)


def random_cands(rng, depth=15, width=8, vocab=50):
    toks = [rng.sample(range(vocab), width) for _ in range(depth)]
    lps = [sorted((-rng.expovariate(1.0) for _ in range(width)), reverse=True) for _ in range(depth)]
    return toks, lps


def brute_ancestry(parents, i, j):
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), budget=st.integers(1, 256), width=st.integers(1, 8), eager=st.booleans())
def test_best_first_invariants(seed, budget, width, eager):
    rng = random.Random(seed)
    toks, lps = random_cands(rng, width=8)
    tree = best_first(7, per_depth(toks, lps), budget, width, 15, eager=eager)
    assert 1 <= len(tree) <= budget
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert 0 <= p < i, "parents before children"
        assert tree.depths[i] == tree.depths[p] + 1 <= 15
        assert tree.logps[i] <= tree.logps[p] + 1e-9
        assert len(tree.children(p)) <= width
    # Enough candidates exist to fill any budget up to 256 unless width/depth cap the tree.
    capacity = sum(width ** d for d in range(16))
    assert len(tree) == min(budget, capacity)
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        for j in range(len(tree)):
            assert bool(mask[i, j]) == brute_ancestry(tree.parents, i, j)


def test_lazy_tree_is_the_top_budget_paths():
    rng = random.Random(3)
    toks, lps = random_cands(rng, depth=4, width=3)
    tree = best_first(0, per_depth(toks, lps), 20, 3, 4, eager=False)
    # Enumerate every path and take the 19 best by cumulative log-prob (prefix-closed because lps <= 0).
    paths = [((), 0.0)]
    frontier = [((), 0.0)]
    for d in range(4):
        frontier = [(p + (k,), s + lps[d][k]) for p, s in frontier for k in range(3)]
        paths += frontier
    best = sorted(s for _, s in paths[1:])[::-1][:19]
    assert sorted(tree.logps[1:], reverse=True) == pytest.approx(best)


def test_budget_checks():
    for bad in (0, -1, 513, 1.5, True):
        with pytest.raises(ValueError):
            check_budget(bad)
    assert check_budget(1) == 1 and check_budget(512) == 512


@pytest.mark.parametrize("n", [1, 31, 32, 33, 256])
def test_packed_mask_round_trip(n):
    rng = random.Random(n)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    dense = ancestor_mask(parents)
    words = pack_bits(dense)
    assert words.dtype == torch.int32 and words.shape == (n, (n + 31) // 32)
    assert torch.equal(unpack_bits(words, n), dense)
    # bit j of row i, little-endian inside int32 words
    i, j = n - 1, rng.randrange(n)
    assert bool((int(words[i, j // 32]) >> (j % 32)) & 1) == bool(dense[i, j])
    padded = pack_bits(dense, words=8 if n <= 256 else None)
    assert torch.equal(unpack_bits(padded, n), dense)


def test_pack_ragged_layout():
    trees = [[-1], [-1, 0, 0, 1], [-1] + list(range(39))]
    words, indptr = pack_ragged(trees)
    assert indptr.tolist() == [0, 1, 5, 45]
    for b, parents in enumerate(trees):
        rows = words[indptr[b]:indptr[b + 1]]
        assert torch.equal(unpack_bits(rows, len(parents)), ancestor_mask(parents))


def test_chain_and_paths():
    t = chain(1, [2, 3, 4])
    assert t.parents == [-1, 0, 1, 2] and t.path_to(3) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        ancestor_mask([-1, 2, 0])


def _paths(tree):
    """{token path: best score} of every non-root node (a tree may hold a path twice)."""
    out, key = {}, {0: ()}
    for v in range(1, len(tree)):
        key[v] = key[tree.parents[v]] + (tree.tokens[v],)
        out[key[v]] = max(out.get(key[v], float("-inf")), tree.logps[v])
    return out


def _random_trie(rng, root, n, vocab=6):
    """A tree with repeated tokens (so paths collide across trees) and scores that fall along every path."""
    tree = DraftTree.root(root)
    while len(tree) < n:
        p = rng.randrange(len(tree))
        tree.add(rng.randrange(vocab), p, tree.logps[p] - rng.choice([0.0, 0.25, 0.5, 1.0, float("inf")]))
    return tree


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), budget=st.integers(1, 64), n_trees=st.integers(1, 3))
def test_merge_is_the_best_prefix_closed_union(seed, budget, n_trees):
    rng = random.Random(seed)
    trees = [_random_trie(rng, 3, rng.randint(1, 40)) for _ in range(n_trees)]
    out = merge(trees, budget)
    paths = _paths(out)
    assert len(out) <= budget and len(paths) == len(out) - 1  # no path twice
    assert all(0 <= p < i for i, p in enumerate(out.parents[1:], 1))
    # brute force: every path's best score over the trees, capped by its prefixes'
    best = {}
    for t in trees:
        for k, lp in _paths(t).items():
            best[k] = max(best.get(k, float("-inf")), lp)
    capped = {k: min(best[k[:i]] for i in range(1, len(k) + 1)) for k in best}
    finite = {k: v for k, v in capped.items() if v > float("-inf")}
    assert paths == {k: finite[k] for k in paths}  # scores as defined
    assert len(paths) == min(budget - 1, len(finite))
    if paths:  # nothing left out scores strictly better than anything kept
        assert max([v for k, v in finite.items() if k not in paths], default=float("-inf")) <= min(paths.values())
    assert out.logps == sorted(out.logps, reverse=True)  # best-first
    smaller = merge(trees, max(1, budget // 2))  # the first b nodes are the budget-b merge
    assert smaller.tokens == out.tokens[:len(smaller)] and smaller.parents == out.parents[:len(smaller)]


def test_merge_of_one_tree_is_that_tree():
    rng = random.Random(5)
    toks, lps = random_cands(rng)
    tree = best_first(9, per_depth(toks, lps), 64, 8, 15)
    for b in (1, 2, 17, 64):
        m = merge([tree], b)
        assert (m.tokens, m.parents, m.depths) == (tree.tokens[:b], tree.parents[:b], tree.depths[:b])


def test_merge_rejects_bad_input():
    a, b = chain(1, [2, 3]), chain(4, [2])
    with pytest.raises(ValueError, match="same root"):
        merge([a, b], 8)
    with pytest.raises(ValueError, match="budget"):
        merge([a], 0)
    a.child_probs = [torch.ones(5) / 5, None, None]
    with pytest.raises(ValueError, match="sampled"):
        merge([a], 8)
