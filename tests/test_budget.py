import random

import pytest

from jetflow_sglang.budget import AdaptiveBudget, parse_budget
from jetflow_sglang.drafters import make_drafter
from jetflow_sglang.engine import autoregressive, run
from jetflow_sglang.target import Target
from tests.helpers import tiny_head, tiny_model


def simulate(batch: int, rounds: int = 300) -> AdaptiveBudget:
    """Acceptance like a decent drafter (geometric along the best-first order); verify time grows with tokens."""
    ctl, rng = AdaptiveBudget(max_budget=256, explore=0.1, seed=1), random.Random(0)
    for _ in range(rounds):
        b = ctl.choose(batch)
        # path nodes at indices 1, 3, 7, 15, ...: deeper acceptance needs a bigger tree
        path = [0]
        for idx in (1, 3, 7, 15, 31, 63, 127, 255):
            if idx < b and rng.random() < 0.8:
                path.append(idx)
            else:
                break
        ctl.observe(path, b, batch, verify_s=0.01 + 0.0005 * batch * b, draft_s=0.002)
    return ctl


def test_budget_shrinks_as_load_grows():
    light, heavy = simulate(batch=1).choose(1), simulate(batch=32).choose(32)
    assert heavy < light, (light, heavy)
    ctl = simulate(batch=1)
    assert ctl.tau(1) == pytest.approx(1.0) and ctl.tau(16) > ctl.tau(4) > 1.0


def test_parse_budget():
    assert parse_budget("auto") == "auto" and parse_budget("32") == 32
    for bad in ("0", "513", "x"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_auto_budget_is_lossless():
    model = tiny_model("llama", vocab=64, seed=4)
    target = Target(model)
    drafter = make_drafter("jetflow", tiny_head(model))
    prompt = list(range(3, 20))
    ref = autoregressive(target, prompt, max_new_tokens=50).tokens
    res = run(target, drafter, prompt, max_new_tokens=50, budget="auto")
    assert res.tokens == ref
    assert len({len(r.tree) for r in res.rounds if r.tree is not None}) > 1, "the budget should move"
