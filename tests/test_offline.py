"""The offline walk used by the benchmark must reproduce the engine's rounds exactly (float32, greedy)."""
import random

import pytest
import torch

from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.engine.loop import autoregressive, run
from jetflow_sglang.engine.offline import OracleDrafter, walk
from jetflow_sglang.engine.target import Target
from tests.helpers import tiny_head, tiny_model

torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["jetflow", "jetflow-branch", "ddtree", "dflash", "ngram"])
def test_walk_matches_engine(name):
    model = tiny_model("qwen3", vocab=64, seed=5)
    target = Target(model)
    drafter = make_drafter(name, tiny_head(model), tiny_head(model, causal=False))
    rng = random.Random(1)
    for budget in (4, 32, 256):
        prompt = [rng.randrange(64) for _ in range(12)]
        ref = autoregressive(target, prompt, max_new_tokens=40).tokens
        _, taps = target.prefill(prompt + ref)
        w = walk(drafter, prompt, ref, taps, budget)
        res = run(target, drafter, prompt, max_new_tokens=40, budget=budget)
        assert res.tokens == ref
        assert (w.steps, w.tokens) == (res.steps, len(res.tokens) - 1)


def test_oracle_is_a_ceiling():
    model = tiny_model("llama", vocab=64, seed=6)
    target = Target(model)
    prompt = list(range(10))
    ref = autoregressive(target, prompt, max_new_tokens=60).tokens
    logits, taps = target.prefill(prompt + ref, all_logits=True)
    # width 1: the target's own argmax chain, 15 deep, is always accepted in full
    chain = walk(OracleDrafter(logits, width=1), prompt, ref, taps, 16)
    assert chain.steps == -(-(len(ref) - 1) // 16)
    tree = walk(OracleDrafter(logits, width=8), prompt, ref, taps, 128)
    assert 1 < tree.tau <= 16
    ar = walk(make_drafter("ar"), prompt, ref, taps, 1)
    assert ar.tau == 1.0
