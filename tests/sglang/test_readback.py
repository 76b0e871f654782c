"""readback.py: a round's phases as `with` blocks, in order, their timings read back a round later (on a CPU: at
once); a phase out of order is refused, and a round that raised midway does not shift the next round's phases."""
import time

import pytest
import torch

from jetflow_sglang.sglang.readback import PHASES, Readback


def _round(rb, budget=4, sleep=None, path=None):
    sleep = sleep or {}
    for name in PHASES:
        with rb.phase(name):
            time.sleep(sleep.get(name, 0))
            if name == PHASES[-1]:
                rb.push(budget, 1, torch.tensor([[0, 2, -1]]) if path is None else path)


def test_phases_time_what_their_blocks_run():
    rb = Readback("cpu")
    _round(rb, sleep={"verify": 0.05, "head": 0.02})
    (r,) = rb.ready()
    assert set(r.split) == set(PHASES) and r.paths == [[0, 2, -1]] and r.budget == 4
    assert r.split["verify"] >= 0.05 and r.split["head"] >= 0.02
    assert r.split["verify"] > r.split["tree"] and r.split["head"] > r.split["accept"]
    assert r.draft_s == pytest.approx(r.split["head"] + r.split["tree"])
    assert rb.ready() == []


def test_out_of_order_phases_and_an_early_push_are_refused():
    rb = Readback("cpu")
    with pytest.raises(RuntimeError, match="out of order"):
        with rb.phase("head"):
            pass
        with rb.phase("verify"):
            pass
    rb = Readback("cpu")
    with rb.phase("head"):
        pass
    with pytest.raises(RuntimeError, match="closed after 1 of its 5 phases"):
        rb.push(4, 1, torch.zeros(1, 2, dtype=torch.long))


def test_a_round_that_raised_midway_leaves_the_next_one_whole():
    rb = Readback("cpu")
    with pytest.raises(ValueError):
        with rb.phase("head"):
            pass
        with rb.phase("tree"):
            raise ValueError("a failed tree build")
    _round(rb, budget=8, sleep={"accept": 0.03})
    (r,) = rb.ready()
    assert r.budget == 8 and r.split["accept"] >= 0.03 and set(r.split) == set(PHASES)
