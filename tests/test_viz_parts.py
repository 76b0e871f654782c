"""The explorer's pure parts: the target's view, colour modes, folding big trees, result files, export/reload,
aligned rounds and the input checks."""
import json
import math
import random
from pathlib import Path

import pytest
import torch

from jetflow_sglang.core.tree import DraftTree, best_first, per_depth
from jetflow_sglang.viz import figures as F
from jetflow_sglang.viz import results as R
from jetflow_sglang.viz.compare import aligned_round
from jetflow_sglang.viz.export import load_run, run_from_dict, run_to_dict, save_run
from jetflow_sglang.viz.session import Session
from jetflow_sglang.viz.target_view import RecordingTarget, round_view

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def small_tree():
    return best_first(7, per_depth([[1, 2, 3]] * 3, [[-0.1, -1.5, -3.0]] * 3), budget=8, width=3, max_depth=3)


def test_round_view_reads_node_probs_and_topk_from_the_verify_logits():
    tree = small_tree()
    logits = torch.randn(len(tree), 11, generator=torch.Generator().manual_seed(0))
    v = round_view(tree, logits, temperature=0.0, k=3)
    probs = logits.softmax(-1)
    for i in range(1, len(tree)):
        assert v.node_p[i] == pytest.approx(float(probs[tree.parents[i], tree.tokens[i]]))
    assert v.node_p[0] is None
    assert v.top_ids[0] == probs[0].topk(3).indices.tolist()
    assert v.top_probs[2] == pytest.approx(probs[2].topk(3).values.tolist(), abs=1e-6)
    # the engine's own top-k wins for the top lists; without logits a node's p is known only inside its parent's top-k
    ids, vals = probs.topk(3, -1)
    only_top = round_view(tree, None, 0.0, engine_top=(ids, vals), k=3)
    for i in range(1, len(tree)):
        row = ids[tree.parents[i]].tolist()
        want = float(vals[tree.parents[i], row.index(tree.tokens[i])]) if tree.tokens[i] in row else None
        assert only_top.node_p[i] == (pytest.approx(want) if want is not None else None)
    assert round_view(tree, None, 0.0) is None
    sampled = round_view(tree, logits, temperature=0.5, top_k=2, k=3)
    assert sum(p > 0 for p in sampled.top_probs[0]) == 2  # the processed (top-k 2) distribution


def test_recording_target_keeps_the_last_verify_logits_and_passes_the_rest():
    class Fake:
        length = 5

        def verify(self, tree):
            return torch.ones(len(tree), 4), "taps"

    rec = RecordingTarget(Fake())
    out = rec.verify(small_tree())
    assert out[1] == "taps" and rec.last_logits is out[0] and rec.length == 5


def test_hover_shows_the_targets_view_and_the_targets_token_is_drawn():
    tree = small_tree()
    logits = torch.full((len(tree), 11), -5.0)
    logits[:, 9] = 5.0  # the target wants token 9 everywhere: nothing drafted is accepted
    v = round_view(tree, logits, 0.0)
    fig = F.tree_figure(tree, [0], decode=lambda t: f"t{t}", view=v, target_token=9)
    tr = {t.name: t for t in fig.data}
    h = tr[F.NODES].hovertext
    assert "target p" in h[1] and "'t9' 1.00" in h[1] and "rejected by the target" in h[1]
    star = tr[F.TARGET_PICK]
    assert list(star.customdata) == [9] and "t9" in star.text[0] and star.x[0] == 0.5
    target_colours = F.tree_figure(tree, [0], view=v, colour="target").data[2].marker.color
    assert list(target_colours)[1:] == pytest.approx(v.node_p[1:])
    agree = F.tree_figure(tree, [0], view=v, colour="agreement").data[2].marker
    assert agree.cmid == 0 and min(agree.color) < -1  # the target gives the drafted tokens far less than the draft
    with pytest.raises(ValueError, match="colour"):
        F.tree_figure(tree, [0], view=v, colour="rainbow")


def big_tree(n=200, seed=3):
    rng = random.Random(seed)
    t = DraftTree.root(0)
    for _ in range(n - 1):
        p = rng.randrange(len(t))
        t.add(rng.randrange(50), p, t.logps[p] + math.log(rng.uniform(0.05, 0.9)))
    return t


def test_folding_keeps_the_path_and_counts_every_hidden_node():
    t = big_tree()
    path = t.path_to(max(range(len(t)), key=lambda i: t.depths[i]))
    for thr, zoom in ((0.01, False), (0.2, False), (0.0, True)):
        shown, folded = F.visible_nodes(t, path, thr, zoom)
        assert set(path) <= set(shown)
        assert len(shown) + sum(folded.values()) == len(t)
        assert all(t.parents[i] in shown for i in shown[1:])  # drawn nodes hang off drawn parents
        if zoom:
            assert set(shown) == set(path) | {k for p in path for k in t.children(p)}
        else:
            assert all(i in path or math.exp(t.logps[i]) >= thr for i in shown)
    fig = F.tree_figure(t, path, threshold=0.05)
    tr = {x.name: x for x in fig.data}
    assert len(tr[F.NODES].x) + sum(tr[F.MORE].customdata) == len(t)
    assert all(s.startswith("+") and s.endswith("more") for s in tr[F.MORE].text)
    small = small_tree()  # trees up to COLLAPSE_MIN nodes are always drawn whole
    assert len(F.tree_figure(small, [0], threshold=0.9).data[2].x) == len(small)


def test_real_tau_files_one_colour_per_drafter_ticks_at_the_budgets_and_a_title():
    for name in ("tau.json", "h200/tau.json"):
        rf = R.load_file(RESULTS / name, name)
        assert rf.kind == "tau" and rf.meta.get("date") and rf.meta["date"] in rf.title() and name in rf.title()
        for ds in [None, R.ALL] + rf.datasets:
            fig = R.tau_figure(rf, ds)
            colours: dict[str, set] = {}
            for t in fig.data:
                if t.name:
                    colours.setdefault(t.name.split(" · ")[0], set()).add(t.line.color)
            assert all(len(c) == 1 for c in colours.values()), colours
            assert len({c for cs in colours.values() for c in cs}) == len(colours)
            budgets = sorted({int(r["budget"]) for r in rf.rows})
            assert list(fig.layout.xaxis.tickvals) == budgets and list(fig.layout.xaxis.ticktext) == [str(b) for b in budgets]
            assert fig.layout.legend.x > 1  # outside the plot area
        for row in R.table(rf):
            assert all(v is None or isinstance(v, (str, int)) or round(v, 2) == v for v in row)
    with pytest.raises(ValueError, match="no dataset"):
        R.tau_figure(R.load_file(RESULTS / "tau.json"), "nope")


def test_serving_file_and_tolerant_layouts(tmp_path):
    rf = R.load_file(RESULTS / "sglang_serving.json")
    assert rf.kind == "serving"
    fig = R.serving_figure(rf)
    levels = sorted({int(r["concurrency"]) for r in rf.rows})
    assert list(fig.layout.xaxis.tickvals) == levels
    assert {t.legendgroup for t in fig.data} == {r["config"] for r in rf.rows}
    # another writer's names for the same things
    rows = [dict(name="b8", clients=c, throughput=10.0 * c, latency_s=1.0 + c) for c in (1, 2, 4)]
    (tmp_path / "s.json").write_text(json.dumps({"data": rows}))
    alt = R.load_file(tmp_path / "s.json")
    assert alt.kind == "serving" and R.table(alt)[2][:3] == ["b8", 4, 40.0]
    (tmp_path / "t.json").write_text(json.dumps({"budget": [16, 32], "method": ["x", "x"], "accept_length": [2, 3]}))
    assert R.table(R.load_file(tmp_path / "t.json")) == [[None, "x", 16, 2, None], [None, "x", 32, 3, None]]
    (tmp_path / "junk.json").write_text(json.dumps([{"note": 1}]))
    with pytest.raises(ValueError, match="no rows with a budget"):
        R.load_file(tmp_path / "junk.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        R.load_file(tmp_path / "bad.json")


def session_with_rounds() -> Session:
    vocab = {1: "a", 2: "b", 3: "c", 4: " d", 5: "<&>", 9: "z"}
    decode = lambda ids: "".join(vocab.get(i, "?") for i in ids)
    s = Session()
    s.reset("p", "jetflow", 8, dict(temperature=0.0, max_tokens=16, eos=True))
    s.add_prefill([1], decode)
    t = small_tree()
    logits = torch.randn(len(t), 11, generator=torch.Generator().manual_seed(1))
    s.add_round(t, [0, 1], [1, 9], 0.1, 0.2, decode, round_view(t, logits, 0.0), lambda i: vocab.get(i, "?"))
    s.add_round(DraftTree.root(9), [0], [5], 0.0, 0.3, decode, None, lambda i: vocab.get(i, "?"))
    s.compute_s, s.ar_tokens_per_s, s.ar_identical = 0.7, 2.0, True
    s.running = False
    return s


def test_export_reloads_to_the_same_run(tmp_path):
    s = session_with_rounds()
    path = save_run(s, tmp_path, {"target": "t"})
    back = load_run(path)
    assert run_to_dict(back, {"target": "t"}) == json.loads(path.read_text())
    assert back.tau == s.tau and back.text == s.text and back.stats_markdown() == s.stats_markdown()
    assert back.rounds[0].target.top_ids == s.rounds[0].target.top_ids and back.rounds[0].target_token == 9
    assert "speedup 2.86x" in s.stats_markdown() and "temperature 0.0" in s.stats_markdown()
    assert "stops at end-of-text" in s.stats_markdown() and "max tokens 16" in s.stats_markdown()
    bad = json.loads(path.read_text())
    bad["rounds"][0]["path"] = [0, 99]
    with pytest.raises(ValueError, match="path leaves its tree"):
        run_from_dict(bad)
    with pytest.raises(ValueError, match="not an exported explorer run"):
        run_from_dict({"rows": []})
    del bad["rounds"][0]["tree"]
    with pytest.raises(ValueError, match="incomplete"):
        run_from_dict(bad)


def test_aligned_round_covers_the_same_text_position():
    a, b = Session(), Session()
    decode = lambda ids: "x" * len(ids)
    for s, lens in ((a, [3, 1, 2, 4]), (b, [1, 1, 5, 3])):
        s.reset("p", "d", 4)
        s.add_prefill([1], decode)
        for n in lens:
            s.add_round(DraftTree.root(1), [0], [1] * n, 0.0, 0.0, decode)
    # a's rounds start at 1, 4, 5, 7; b's at 1, 2, 3, 8
    assert [aligned_round(a, b, k) for k in (1, 2, 3, 4)] == [1, 3, 3, 3]
    assert aligned_round(a, Session(), 1) == 0


def test_check_inputs_refuses_out_of_range_values_instead_of_clamping():
    from jetflow_sglang.viz.models import InputError, check_inputs

    class M:
        unavailable = {}

        def available(self):
            return ["jetflow", "ngram"]

    ok = check_inputs(M(), "hi", "ngram", 16.0, 0.5, "32")
    assert ok == ("ngram", 16, 0.5, 32)
    for args, msg in (((-5, 0, 8), "Budget must be between 1"), ((16, 50, 8), "Temperature must be between 0"),
                      ((16, 0, 10**6), "Max tokens must be between 1"), ((2.5, 0, 8), "whole number"),
                      (("x", 0, 8), "must be a number")):
        with pytest.raises(InputError, match=msg):
            check_inputs(M(), "hi", "ngram", *args)
