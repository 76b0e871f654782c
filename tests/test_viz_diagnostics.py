"""The explorer's acceptance diagnostics on hand-made rounds, where every number can be counted by hand."""
import math

import pytest

from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.viz import diagnostics as D


def tree_of(edges) -> DraftTree:
    """edges: (token, parent, per-step draft p), parent-before-child."""
    t = DraftTree.root(0)
    for tok, parent, p in edges:
        t.add(tok, parent, t.logps[parent] + math.log(p))
    return t


def rounds():
    # 1: root -> a(.65) -> c(.55), root -> b(.35); accepted a, then c rejected
    t1 = tree_of([(1, 0, 0.65), (2, 0, 0.35), (3, 1, 0.55)])
    # 2: a chain x(.95) -> y(.85), both accepted, y has no children
    t2 = tree_of([(4, 0, 0.95), (5, 1, 0.85)])
    # 3: u(.25) rejected;  4: v(.62) rejected
    t3 = tree_of([(6, 0, 0.25)])
    t4 = tree_of([(7, 0, 0.62)])
    return [(t1, [0, 1]), (t2, [0, 1, 2]), (t3, [0]), (t4, [0])]


def test_step_probs_and_sibling_ranks():
    t1 = rounds()[0][0]
    assert D.step_probs(t1) == pytest.approx([1.0, 0.65, 0.35, 0.55])
    assert D.sibling_ranks(t1) == [0, 1, 2, 1]
    tie = tree_of([(1, 0, 0.5), (2, 0, 0.5)])
    assert D.sibling_ranks(tie) == [0, 1, 2]  # ties: earlier node first


def test_tried_nodes_are_children_of_the_accepted_path():
    t1, path = rounds()[0]
    assert D.tried_nodes(t1, path) == [(1, True), (2, False), (3, False)]
    t = tree_of([(1, 0, 0.9), (2, 1, 0.9), (3, 0, 0.1), (4, 3, 0.9)])  # node 4 sits under a rejected parent
    assert {n for n, _ in D.tried_nodes(t, [0, 1])} == {1, 2, 3}


def test_acceptance_by_depth():
    got = {r.label: (r.accepted, r.tried) for r in D.by_depth(rounds())}
    # depth 1: all four rounds offered a child, rounds 1 and 2 accepted one;
    # depth 2: rounds 1 and 2 reached depth 1 with children below, only round 2 accepted
    assert got == {"1": (2, 4), "2": (1, 2)}
    assert [r.rate for r in D.by_depth(rounds())] == [0.5, 0.5]
    assert D.by_depth([]) == []


def test_acceptance_by_sibling_rank():
    got = {r.label: (r.accepted, r.tried) for r in D.by_rank(rounds())}
    # rank 1 tried: a, c, x, y, u, v (accepted a, x, y); rank 2 tried: b (rejected); no rank 9+
    assert got == {"rank 1": (3, 6), "ranks 2-8": (0, 1)}
    wide = tree_of([(k, 0, 0.09 - k * 0.001) for k in range(10)])
    ranks = {r.label: (r.accepted, r.tried) for r in D.by_rank([(wide, [0, 10])])}
    assert ranks == {"rank 1": (0, 1), "ranks 2-8": (0, 7), "rank 9+": (1, 2)}


def test_calibration_bins():
    bins = D.calibration(rounds(), bins=10)
    got = {round(b.lo, 1): (b.count, b.accepted) for b in bins}
    assert got == {0.2: (1, 0), 0.3: (1, 0), 0.5: (1, 0), 0.6: (2, 1), 0.8: (1, 1), 0.9: (1, 1)}
    six = next(b for b in bins if round(b.lo, 1) == 0.6)
    assert six.mean_p == pytest.approx((0.65 + 0.62) / 2) and six.rate == 0.5 and six.hi == pytest.approx(0.7)
    assert sum(b.count for b in bins) == 7  # every tried node lands in exactly one bin
    two = D.calibration(rounds(), bins=2)
    assert [(b.count, b.accepted) for b in two] == [(2, 0), (5, 3)]


def test_calibration_edges():
    sure = tree_of([(1, 0, 1.0)])
    (b,) = D.calibration([(sure, [0, 1])], bins=10)
    assert (b.lo, b.count, b.accepted) == (pytest.approx(0.9), 1, 1)  # p = 1 goes into the last bin
    assert D.calibration([(DraftTree.root(5), [0])]) == []  # nothing drafted, nothing tried
    with pytest.raises(ValueError, match="bins"):
        D.calibration(rounds(), bins=0)
