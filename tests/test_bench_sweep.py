"""The budget sweep's pieces (scripts/bench_serving.py --sets, jetflow-bN; scripts/bench_ragged.py): the held-out
prompt sets load from ../shared/data, fixed-budget config names parse, and the per-request budget estimate picks
what a brute force over the measured curves picks."""
import math
from pathlib import Path

import pytest

from tests.scripts import load_script

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.mark.skipif(not SHARED.is_dir(), reason="no ../shared/data beside the checkout")
def test_every_set_loads_held_out_prompts():
    bench = load_script("bench_serving")
    for name in bench.SETS:
        prompts = bench.load_set(name, 3)
        assert len(prompts) == 3 and all(isinstance(p, str) and len(p) > 20 for p in prompts), name
    code = bench.load_set("humaneval", 1)[0]
    assert code.startswith("Complete this Python function.\n\n") and "def " in code
    for name, tokens in bench.LONG_SETS.items():  # long contexts: different documents, about the size named
        long = bench.load_set(name, 2)
        assert long[0] != long[1] and all(2 * tokens <= len(p) < 2 * tokens + 6000 for p in long), name
        assert long[0].endswith("in order.") and "Solution." in long[0]


def test_fixed_budget_config_names():
    bench = load_script("bench_serving")
    assert [bench.jetflow_budget(n) for n in ("jetflow-b1", "jetflow-b32", "jetflow-default", "jetflow-b8-nolookup",
                                              "dflash-b8")] == [1, 32, None, None, None]
    args, env = bench.config_args("jetflow-b32", "HEAD", "jetflow")
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "32" and "JETFLOW_BUDGET" not in env
    args, _ = bench.config_args("jetflow-default", "HEAD", "jetflow")
    assert "--speculative-num-draft-tokens" not in args  # what a user gets with no budget flag
    args, env = bench.config_args("jetflow-b8-graphs", "HEAD", "jetflow")
    assert env["JETFLOW_GRAPHS"] == "on" and args[args.index("--speculative-num-draft-tokens") + 1] == "8"


def _row(workload, config, tau, round_s):
    return {"workload": workload, "config": config, "concurrency": 4, "accept_length": tau,
            "round_jetflow": [{"round_split": {"verify": round_s}}]}


def test_ragged_estimate_gives_each_request_its_own_best_tree():
    """A set whose drafts are never accepted should get the smallest tree, and a set that accepts deep ones the
    largest; one budget for the batch must compromise, so ragged wins by what the brute force says."""
    ragged = load_script("bench_ragged")
    rows = [_row("chat", "jetflow-b1", None, 0.10), _row("math", "jetflow-b1", None, 0.10),
            _row("chat", "jetflow-b16", 1.05, 0.20), _row("math", "jetflow-b16", 4.0, 0.20)]
    tau, cost = ragged.curves(rows, 4)
    assert tau == {"chat": {1: 1.0, 16: 1.05}, "math": {1: 1.0, 16: 4.0}} and cost == {4: 0.10, 64: 0.20}
    est = ragged.estimate(tau, cost, 4)  # two requests from each set
    assert est["uniform"]["budgets"] == {"chat": 16, "math": 16}
    assert est["ragged"]["budgets"] == {"chat": 1, "math": 16}
    # uniform: 2 (1.05 + 4) / 0.2; ragged: 2 (1 + 4) / cost(34 tokens), log-linear between 4 and 64 tokens
    c34 = 0.10 + 0.10 * math.log2(34 / 4) / math.log2(64 / 4)
    assert est["gain"] == pytest.approx((10.0 / c34) / (10.1 / 0.2), rel=1e-3)
    with pytest.raises(ValueError, match="evenly"):
        ragged.estimate(tau, cost, 3)
