"""Greedy speculative decoding must be token-identical to plain greedy decoding (float32), over many random cases."""
import random

import pytest
import torch

from jetflow_sglang.draft.drafters import DRAFTERS, ARDrafter, make_drafter
from jetflow_sglang.engine.loop import autoregressive, run
from jetflow_sglang.engine.target import Target
from jetflow_sglang.kernels import hf_tree_attention as tree_attn
from tests.helpers import tiny_head, tiny_model

torch.set_num_threads(1)
VOCAB = 64


class RefTreeDrafter(ARDrafter):
    """Random trees that contain (a possibly corrupted prefix of) the true continuation somewhere inside."""
    name = "reftree"

    def __init__(self, prompt_len, reference, rng):
        self.prompt_len, self.reference, self.rng = prompt_len, reference, rng

    def draft(self, state, anchor, budget, temperature=0.0, generator=None):
        tree = super().draft(state, anchor, budget)
        pos = len(state.tokens) - self.prompt_len  # reference[pos] is the anchor
        truth = self.reference[pos + 1: pos + 1 + self.rng.randint(0, 20)]
        if truth and self.rng.random() < 0.3:
            truth[self.rng.randrange(len(truth))] = self.rng.randrange(VOCAB)  # a wrong token mid-path
        chain_end, k = 0, 0
        while len(tree) < budget:
            if k < len(truth) and self.rng.random() < 0.5:
                chain_end = tree.add(truth[k], chain_end, 0.0)
                k += 1
            else:
                tree.add(self.rng.randrange(VOCAB), self.rng.randrange(len(tree)), 0.0)
        return tree


@pytest.fixture(scope="module")
def stacks():
    out = {}
    for fam in ("llama", "qwen3"):
        model = tiny_model(fam, vocab=VOCAB, seed=11)
        if fam == "qwen3":  # verify through the packed-mask attention the CLI uses; llama keeps the dense float mask
            model.set_attn_implementation(tree_attn.NAME)
        out[fam] = (Target(model), tiny_head(model, causal=True), tiny_head(model, causal=False, seed=2))
    return out


CASES = 240


@pytest.mark.parametrize("chunk", range(8))
def test_greedy_is_token_identical(stacks, chunk):
    inside = merged = 0
    for case in range(chunk * CASES // 8, (chunk + 1) * CASES // 8):
        rng = random.Random(case)
        fam = rng.choice(["llama", "qwen3"])
        target, head, bidir = stacks[fam]
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        full = autoregressive(target, prompt, max_new_tokens=60).tokens
        max_new = rng.randint(1, 50)
        eos = {full[rng.randrange(len(full))]} if rng.random() < 0.5 else set()
        ref = autoregressive(target, prompt, max_new_tokens=max_new, eos_ids=eos).tokens
        budget = rng.choice([1, 2, 3, 5, 8, 16, 17, 32, 64, 100, 128, 255, 256])
        name = rng.choice(list(DRAFTERS) + ["reftree"] * 4)
        tree = rng.choice(["exact", "exact", "paper"])  # the exact vectorized builder is the default path
        lookup = False
        if name == "reftree":
            drafter = RefTreeDrafter(len(prompt), full, rng)
        else:  # head drafters merge prompt-lookup tries into their trees in a third of the cases
            drafter = make_drafter(name, head, bidir, width=rng.randint(1, 8), tree=tree, lookup=rng.random() < 1 / 3)
            lookup = hasattr(drafter, "lookup")
        res = run(target, drafter, prompt, max_new_tokens=max_new, budget=budget, eos_ids=eos)
        assert res.tokens == ref, \
            f"case {case}: {fam} {name} ({tree}) lookup={lookup} budget={budget} max_new={max_new} eos={eos}"
        last = res.rounds[-1]
        if last.tree is not None and len(last.new_tokens) < len(last.path):
            inside += 1  # the stop (EOS or limit) cut an accepted path short
        merged += lookup
    assert inside >= 3, "the cases must exercise stops that fall inside an accepted path"
    assert merged >= 2, "the cases must exercise trees merged with prompt lookup"
