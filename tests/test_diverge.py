import pytest
import torch

from jetflow_sglang.engine.diverge import NEAR_TIE, first_divergence, format_divergence
from jetflow_sglang.engine.loop import autoregressive
from tests.helpers import tiny_target


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=5, vocab=64)
    prompt = list(range(3, 15))
    ref = autoregressive(target, prompt, max_new_tokens=12).tokens
    return target, prompt, ref


def test_identical_runs_have_no_divergence(setup):
    target, prompt, ref = setup
    assert first_divergence(target, prompt, ref, list(ref)) is None
    assert format_divergence(None) == "identical to AR: True"


def test_reports_position_tokens_and_margins_both_ways(setup):
    target, prompt, ref = setup
    pos = 5
    other = (ref[pos] + 1) % 64
    spec = ref[:pos] + [other] + ref[pos + 1:]
    d = first_divergence(target, prompt, spec, ref)
    assert (d["position"], d["a_token"], d["b_token"]) == (pos, other, ref[pos])
    # recompute the AR logits by hand: the prefix fed token by token
    with torch.no_grad():
        full = target.model(input_ids=torch.tensor([prompt + ref[:pos]])).logits[0, -1]
    top = full.topk(2).values
    assert d["margin_ar"] == pytest.approx(float(top[0] - top[1]), abs=1e-3)
    assert d["margin_a"] == pytest.approx(d["margin_ar"], abs=1e-3)  # float32: both computations agree
    assert d["top2_ar"][0][0] == ref[pos] and d["gap_ar"] < 0  # AR prefers its own token
    assert d["gap_ar"] == pytest.approx(float(full[other] - full[ref[pos]]), abs=1e-3)
    assert d["near_tie"] == (d["margin_ar"] < NEAR_TIE) and not d["explained"]
    text = format_divergence(d)
    assert f"new token {pos}" in text and "margin" in text


def test_a_shorter_run_diverges_where_it_stops(setup):
    target, prompt, ref = setup
    d = first_divergence(target, prompt, ref[:4], ref)
    assert d["position"] == 4 and d["a_token"] is None and d["b_token"] == ref[4]
    assert "stopped earlier" in format_divergence(d)


def test_divergence_at_the_first_token(setup):
    target, prompt, ref = setup
    d = first_divergence(target, prompt, [(ref[0] + 1) % 64], ref[:1])
    assert d["position"] == 0 and d["margin_a"] == pytest.approx(d["margin_ar"], abs=1e-4)


def test_bad_input_is_a_clear_error(setup):
    target, _, ref = setup
    with pytest.raises(ValueError, match="empty prompt"):
        first_divergence(target, [], ref, ref)
