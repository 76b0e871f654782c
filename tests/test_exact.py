"""Exact rows (jetflow_sglang/engine/exact.py): in bfloat16 on a CPU, greedy speculative output is token-identical to plain
decoding, because every verify row rounds exactly as a one-token step does. Without them it is not (a check that
can fail, and does on the stock kernels)."""
import random

import pytest
import torch

from jetflow_sglang.engine import exact
from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.engine.loop import autoregressive, run
from jetflow_sglang.engine.target import Target
from jetflow_sglang.kernels import hf_tree_attention as tree_attn
from tests.helpers import tiny_head, tiny_model

VOCAB = 256


def _bf16_target(family: str, seed: int = 3, hidden: int = 128) -> Target:
    model = tiny_model(family, vocab=VOCAB, hidden=hidden, layers=2, seed=seed).to(torch.bfloat16)
    model.set_attn_implementation(tree_attn.NAME)
    return Target(model)


@pytest.fixture(scope="module")
def bf16_stacks():
    out = {}
    for fam in ("llama", "qwen3"):
        target = _bf16_target(fam)
        out[fam] = (target, tiny_head(target.model.float(), seed=5).to(torch.bfloat16))
        target.model.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_check_finds_stock_rounding_and_passes_with_exact_rows(family):
    target = _bf16_target(family)
    exact.enable(target, False)
    stock = exact.check(target)
    exact.enable(target, True)
    fixed = exact.check(target)
    assert not stock["ok"] and stock["mismatches"] > 0, stock  # bf16 verify rows round unlike one-token steps
    assert fixed == {"ok": True, "cases": stock["cases"], "mismatches": 0, "max_abs_diff": 0.0}


def test_check_fails_when_a_row_depends_on_the_tree_size(monkeypatch):
    target = _bf16_target("llama")
    exact.enable(target, True)
    real = tree_attn.cpu_tree_attention

    def skewed(query, key, value, bias, scaling):  # rounds like the real one, plus a term that grows with the tree
        return real(query, key, value, bias, scaling) + (query.shape[2] - 1) * 1e-2

    monkeypatch.setattr(tree_attn, "cpu_tree_attention", skewed)
    res = exact.check(target)
    assert not res["ok"] and res["max_abs_diff"] > 0


def test_setup_modes():
    target = _bf16_target("llama")
    assert exact.setup(target, "on") is True and target.exact is True
    assert exact.setup(target, "off") is False and target.exact is False
    with pytest.raises(ValueError, match="exact must be"):
        exact.setup(target, "auto")
    dense = Target(tiny_model("llama", vocab=VOCAB))  # verifies with a dense float mask, not the tree attention
    with pytest.raises(ValueError, match="CPU targets"):
        exact.setup(dense, "on")


@pytest.mark.parametrize("chunk", range(3))
def test_bf16_greedy_is_token_identical_with_exact_rows(bf16_stacks, chunk):
    for case in range(chunk * 20, chunk * 20 + 20):
        rng = random.Random(case)
        fam = rng.choice(["llama", "qwen3"])
        target, head = bf16_stacks[fam]
        exact.enable(target, True)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        max_new = rng.randint(8, 48)
        ref = autoregressive(target, prompt, max_new_tokens=max_new).tokens
        budget = rng.choice([1, 2, 3, 4, 8, 16, 33, 64, 128, 256, "auto"])
        drafter = make_drafter(rng.choice(["jetflow", "jetflow-branch", "ngram"]), head, None,
                               width=rng.randint(1, 8), lookup=rng.random() < 0.3)
        res = run(target, drafter, prompt, max_new_tokens=max_new, budget=budget)
        assert res.tokens == ref, f"case {case}: {fam} {drafter.name} budget={budget} max_new={max_new}"


def test_bf16_without_exact_rows_can_differ(bf16_stacks):
    """The same cases with stock rounding: at least one text parts from plain decoding (what exact rows fix). If this
    ever passes with no difference, the cases above have stopped exercising the rounding and must be made harder."""
    differ = 0
    for case in range(40):
        rng = random.Random(1000 + case)
        fam = rng.choice(["llama", "qwen3"])
        target, head = bf16_stacks[fam]
        exact.enable(target, False)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        ref = autoregressive(target, prompt, max_new_tokens=48).tokens
        res = run(target, make_drafter("ngram", None, None, width=4), prompt, max_new_tokens=48, budget=64)
        differ += res.tokens != ref
        exact.enable(target, True)
    assert differ >= 1, differ  # 4 of 40 on a 2-core EPYC with AVX512-BF16


def test_default_model_bf16_is_token_identical_to_plain_decoding():
    """The shipped target and head as `jetflow generate --dtype bfloat16 --exact on` loads them: the default drafter at
    auto and fixed budgets writes exactly what plain decoding writes."""
    from jetflow_sglang.paths import default_paths
    from jetflow_sglang.engine.stack import load_stack

    default_paths()  # converts the shipped GGUF once
    target, drafter = load_stack(dtype="bfloat16", drafter="jetflow", lookup=True, exact="on")
    assert exact.check(target)["ok"]
    target.prefill([1])
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?", "def fibonacci(n):"]
    for text in prompts:
        ids = target.encode_chat(text)
        ref = autoregressive(target, ids, max_new_tokens=32, eos_ids=target.eos_ids()).tokens
        for budget in ("auto", 64):  # bf16 is emulated on an AVX2 CPU: ~15 s a run (the random cases above: 16)
            got = run(target, drafter, ids, max_new_tokens=32, budget=budget, eos_ids=target.eos_ids()).tokens
            assert got == ref, f"{text[:30]!r} budget={budget}"
