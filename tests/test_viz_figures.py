"""Figure builders of the explorer: the plot must show exactly the tree it is given and mark the accepted path."""
import math
import random

import pytest

from hypothesis import given, settings, strategies as st

from jetflow_sglang.core.tree import DraftTree, best_first, per_depth
from jetflow_sglang.viz import figures as F


def random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree.root(rng.randrange(100))
    for _ in range(n - 1):
        parent = rng.randrange(len(tree))
        tree.add(rng.randrange(100), parent, tree.logps[parent] + math.log(rng.uniform(0.05, 1.0)))
    return tree


def traces(fig):
    return {t.name: t for t in fig.data}


def segments(trace) -> list[tuple[tuple, tuple]]:
    xs, ys = list(trace.x or []), list(trace.y or [])
    assert len(xs) % 3 == 0 and all(v is None for v in xs[2::3])
    return [((xs[i], ys[i]), (xs[i + 1], ys[i + 1])) for i in range(0, len(xs), 3)]


def deepest_path(tree: DraftTree) -> list[int]:
    return tree.path_to(max(range(len(tree)), key=lambda i: (tree.depths[i], -i)))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), seed=st.integers(0, 10**6))
def test_nodes_edges_and_path_match_the_tree(n, seed):
    tree = random_tree(random.Random(seed), n)
    path = deepest_path(tree)
    fig = F.tree_figure(tree, path, decode=lambda t: f"t{t}")
    tr = traces(fig)
    nodes, acc = tr[F.NODES], tr[F.PATH]
    assert len(nodes.x) == len(tree)
    assert list(nodes.customdata) == list(range(len(tree)))
    # one edge per non-root node, split between the dimmed and the highlighted trace
    dim, hi = segments(tr[F.EDGES]), segments(tr[F.PATH_EDGES])
    assert len(dim) + len(hi) == len(tree) - 1
    assert len(hi) == len(path) - 1
    # the highlighted trace holds exactly the accepted nodes, at the same positions as in the node trace
    assert list(acc.customdata) == path
    pos = {i: (nodes.x[i], nodes.y[i]) for i in range(len(tree))}
    assert [(x, y) for x, y in zip(acc.x, acc.y)] == [pos[i] for i in path]
    assert {frozenset(s) for s in hi} == {frozenset((pos[a], pos[b])) for a, b in zip(path, path[1:])}
    # every edge joins a parent to its child, one depth to the right
    want = {frozenset((pos[p], pos[i])) for i, p in enumerate(tree.parents) if p >= 0}
    assert {frozenset(s) for s in dim + hi} == want
    assert all(pos[i][0] == tree.depths[i] for i in range(len(tree)))
    assert len(set(pos.values())) == len(tree), "two nodes drawn on top of each other"
    # colour = per-step draft probability (not the cumulative one); off-path nodes dimmed, path nodes opaque
    step = [1.0] + [math.exp(tree.logps[i] - tree.logps[tree.parents[i]]) for i in range(1, len(tree))]
    assert list(nodes.marker.color) == pytest.approx(step)
    op = list(nodes.marker.opacity)
    assert all(op[i] == 1.0 for i in path) and all(op[i] < 1.0 for i in range(len(tree)) if i not in path)


def test_hover_shows_token_depth_and_cumulative_logprob():
    tree = best_first(7, per_depth([[1, 2, 3]] * 4, [[-0.1, -1.5, -3.0]] * 4), budget=12, width=3, max_depth=4)
    names = {7: "The", 1: " cat", 2: "\n", 3: "sat"}
    fig = F.tree_figure(tree, tree.path_to(2), decode=names.get)
    nodes = traces(fig)[F.NODES]
    for i in range(len(tree)):
        h = nodes.hovertext[i]
        assert repr(names[tree.tokens[i]]) in h and f"depth {tree.depths[i]}" in h
        assert i == 0 or f"{tree.logps[i]:.3f}" in h
    assert "<b>accepted</b>" in nodes.hovertext[2] and "<b>accepted</b>" not in nodes.hovertext[3]
    assert nodes.text[1] == "·cat" and nodes.text[2] != ""  # spaces made visible


def test_siblings_are_ordered_best_first_and_subtrees_do_not_interleave():
    tree = best_first(0, per_depth([[1, 2]] * 3, [[-0.2, -1.0]] * 3), budget=15, width=2, max_depth=3)
    pos = F.tree_layout(tree)
    for i in range(len(tree)):
        kids = sorted(tree.children(i), key=lambda k: -tree.logps[k])
        assert [pos[k][1] for k in kids] == sorted((pos[k][1] for k in kids), reverse=True)


def test_no_path_draws_everything_undimmed_and_bad_path_is_rejected():
    tree = random_tree(random.Random(1), 10)
    tr = traces(F.tree_figure(tree))
    assert len(tr[F.PATH].x) == 0 and all(o == 1.0 for o in tr[F.NODES].marker.opacity)
    with pytest.raises(ValueError, match="outside the tree"):
        F.tree_figure(tree, [0, 10])


def test_large_tree_keeps_labels_on_the_path_only():
    tree = random_tree(random.Random(2), 256)
    path = deepest_path(tree)
    nodes = traces(F.tree_figure(tree, path))[F.NODES]
    assert len(nodes.x) == 256
    assert {i for i, t in enumerate(nodes.text) if t} == set(path)


def test_accept_histogram_counts_rounds():
    bar = F.accept_histogram([1, 3, 3, 2, 3]).data[0]
    assert dict(zip(bar.x, bar.y)) == {1: 1, 2: 1, 3: 3}


def test_sweep_figure_is_tolerant_of_partial_rows():
    rows = [dict(dataset="gsm8k", drafter="jetflow", budget=b, tau=1 + b / 64, speedup=1 + b / 128) for b in (1, 16, 64)]
    rows += [dict(drafter="ngram", budget=16, tau=1.4), dict(drafter="ngram", budget="x", tau=2.0),
             dict(drafter="ngram", budget=32, tau=None, speedup=float("nan")), {"note": "junk"}]
    fig = F.sweep_figure(rows)
    by = {(t.name, t.xaxis): t for t in fig.data if t.name}
    jet_tau, jet_speed = by[("gsm8k / jetflow", "x")], by[("gsm8k / jetflow", "x2")]
    assert list(jet_tau.x) == [1, 16, 64] and list(jet_tau.y) == pytest.approx([1 + 1 / 64, 1.25, 2.0])
    assert list(jet_speed.y) == pytest.approx([1 + 1 / 128, 1.125, 1.5])
    assert list(by[("ngram", "x")].x) == [16] and ("ngram", "x2") not in by


def test_session_splits_text_by_round_and_computes_tau():
    from jetflow_sglang.viz.session import Session

    vocab = {1: "a", 2: "b", 3: "c", 4: " d", 5: "<&>"}
    decode = lambda ids: "".join(vocab[i] for i in ids)
    s = Session()
    s.reset("p", "jetflow", 8)
    s.add_prefill([1], decode)
    t = best_first(1, per_depth([[2, 3]] * 3, [[-0.1, -2.0]] * 3), budget=6, width=2, max_depth=3)
    path = t.path_to(max(i for i in range(len(t)) if t.tokens[i] == 2 and t.depths[i] == 2))
    s.add_round(t, path, [2, 2, 4], 0.1, 0.2, decode)     # two drafted tokens accepted, bonus " d"
    s.add_round(DraftTree.root(4), [0], [5], 0.0, 0.3, decode)  # nothing drafted: the target's token only
    assert [r.n_drafted for r in s.rounds] == [2, 0]
    assert (s.rounds[0].drafted_text, s.rounds[0].bonus_text) == ("bb", " d")
    assert s.tau == pytest.approx(2.0) and s.tokens_per_s == pytest.approx(4 / 0.6)
    assert s.rounds[0].tree.child_probs is None and len(s.rounds[0].tree) == len(t)
    page = s.text_html()
    assert '<span class="jf-acc">bb</span> d' in page and "&lt;&amp;&gt;" in page and "<&>" not in page


def test_load_results_accepts_common_layouts(tmp_path):
    from jetflow_sglang.viz.sweep import list_results, load_results

    rows = [dict(dataset="d", drafter="jetflow", budget=16, tau=2.0, speedup=1.5)]
    (tmp_path / "a.json").write_text(__import__("json").dumps(rows))
    (tmp_path / "b.json").write_text(__import__("json").dumps({"rows": rows + [{"drafter": "x"}]}))
    (tmp_path / "c.json").write_text(__import__("json").dumps({k: [v] for k, v in rows[0].items()}))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "a.json").write_text(__import__("json").dumps(rows))
    assert list_results(tmp_path) == [str(tmp_path / f) for f in ("a.json", "b.json", "bad.json", "c.json", "gpu/a.json")]
    for f in ("a.json", "b.json", "c.json"):
        assert load_results(tmp_path / f) == rows
    with pytest.raises(ValueError, match="cannot read"):
        load_results(tmp_path / "bad.json")
    assert list_results(tmp_path / "missing") == []
