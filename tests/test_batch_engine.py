"""Batched generation (one head forward and one verify forward per round) must match per-prompt runs in float32."""
import random

import pytest
import torch

from jetflow_sglang.draft.context_kv import ContextKV
from jetflow_sglang.draft.drafters import make_drafter
from jetflow_sglang.engine.loop import autoregressive, generate, generate_batch, run
from jetflow_sglang.engine.target import Target
from jetflow_sglang.kernels import hf_tree_attention as tree_attn
from tests.helpers import tiny_head, tiny_model

torch.set_num_threads(1)
VOCAB = 64


@pytest.fixture(scope="module")
def stacks():
    out = {}
    for fam in ("llama", "qwen3"):
        model = tiny_model(fam, vocab=VOCAB, seed=21)
        if fam == "qwen3":
            model.set_attn_implementation(tree_attn.NAME)
        out[fam] = (Target(model), tiny_head(model, causal=True), tiny_head(model, causal=False, seed=2))
    return out


CASES = [("llama", "jetflow", "exact", 16), ("qwen3", "jetflow", "paper", 32), ("llama", "jetflow-branch", "exact", 24),
         ("qwen3", "ddtree", "exact", 64), ("llama", "dflash", "exact", 8), ("qwen3", "ngram", "exact", 16),
         ("llama", "jetflow", "exact", 1), ("qwen3", "ar", "exact", 1)]


@pytest.mark.parametrize("fam,name,tree,budget", CASES)
def test_batch_is_token_identical_to_single_runs(stacks, fam, name, tree, budget):
    target, head, bidir = stacks[fam]
    rng = random.Random(hash((fam, name, budget)) % 1000)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    prompts.append(prompts[0][:3] * 4)  # a repetitive prompt: long accepted paths
    drafter = make_drafter(name, head, bidir, width=rng.randint(2, 8), tree=tree)
    max_new = 24
    full = [autoregressive(target, p, max_new_tokens=max_new).tokens for p in prompts]
    eos = {full[1][5]}  # request 1 stops early (maybe mid-path); the others run to the limit unless they hit it too
    res = generate_batch(target, drafter, prompts, max_new_tokens=max_new, budget=budget, eos_ids=eos)
    steps = []
    for p, r in zip(prompts, res):
        single = run(target, drafter, p, max_new_tokens=max_new, budget=budget, eos_ids=eos)
        ref = autoregressive(target, p, max_new_tokens=max_new, eos_ids=eos).tokens
        assert r.tokens == single.tokens == ref
        assert all(len(rd.new_tokens) >= 1 for rd in r.rounds)
        steps.append((r.steps, single.steps))
    # the batched drafter builds the same trees as the single one (up to float near-ties in padded attention)
    assert sum(a != b for a, b in steps) <= 1, steps


@pytest.mark.parametrize("fam,name,budget", [("llama", "jetflow", 8), ("qwen3", "ddtree", 16), ("llama", "dflash", 4)])
def test_batch_with_lookup_is_token_identical_to_single_runs(stacks, fam, name, budget):
    target, head, bidir = stacks[fam]
    rng = random.Random(budget)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    prompts.append([5, 9, 11, 3] * 6)  # repeats itself: the lookup trie has something to offer
    drafter = make_drafter(name, head, bidir, width=4, lookup=True)
    assert drafter.name == f"{name}+lookup"
    res = generate_batch(target, drafter, prompts, max_new_tokens=20, budget=budget)
    merged_rounds = 0
    for p, r in zip(prompts, res):
        single = run(target, drafter, p, max_new_tokens=20, budget=budget)
        assert r.tokens == single.tokens == autoregressive(target, p, max_new_tokens=20).tokens
        plain = run(target, drafter.base, p, max_new_tokens=20, budget=budget)
        merged_rounds += sum(a.tree.tokens != b.tree.tokens for a, b in zip(single.rounds[1:], plain.rounds[1:]))
    assert merged_rounds > 0  # the lookup changed some trees


def test_lookup_leaves_sampled_trees_to_the_head(stacks):
    target, head, _ = stacks["llama"]
    drafter = make_drafter("jetflow", head, lookup=True)
    state = drafter.new_state([1, 2, 3, 1, 2, 3, 1, 2], target.prefill([1, 2, 3, 1, 2, 3, 1, 2])[1])
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    t = drafter.draft(state, 3, 8, temperature=0.7, generator=gen_a)
    ref = drafter.base.draft(state, 3, 8, temperature=0.7, generator=gen_b)
    assert t.tokens == ref.tokens and t.child_probs is not None
    greedy = drafter.draft(state, 3, 8)
    assert (1, 2) in {(greedy.tokens[c], greedy.tokens[g]) for c in greedy.children(0) for g in greedy.children(c)}


def test_batch_rejects_bad_input(stacks):
    target, head, _ = stacks["llama"]
    drafter = make_drafter("jetflow", head)
    with pytest.raises(ValueError):
        generate_batch(target, drafter, [], budget=4)
    with pytest.raises(ValueError):
        generate_batch(target, drafter, [[1, 2]], temperature=0.5)
    with pytest.raises(ValueError):
        generate_batch(target, drafter, [[1, 2], []])


def test_budget_one_runs_no_head_forward_but_keeps_the_context(stacks, monkeypatch):
    target, head, _ = stacks["llama"]
    drafter = make_drafter("jetflow", head)
    states, calls = [], []
    new_state = drafter.new_state
    monkeypatch.setattr(drafter, "new_state", lambda *a: states.append(new_state(*a)) or states[-1])
    original = type(head).forward
    monkeypatch.setattr(type(head), "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    rounds = list(generate(target, drafter, prompt, max_new_tokens=10, budget=1))
    assert not calls and all(r.tree is None or len(r.tree) == 1 for r in rounds)
    tokens = [t for r in rounds for t in r.new_tokens]
    committed = prompt + tokens[:-1]  # the last token is the next anchor, not yet committed
    state = states[0]
    assert state.tokens == committed
    _, taps = target.prefill(committed)
    fresh = drafter.new_state(committed, taps)
    assert state.pending  # plain rounds only queue their rows; the next head forward projects them
    for (k, v), (fk, fv) in zip(drafter.context(state), drafter.context(fresh)):
        torch.testing.assert_close(k, fk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, fv, atol=1e-4, rtol=1e-4)


def test_context_grows_geometrically_and_appends_in_place():
    k = torch.randn(2, 2, 5, 4)
    ctx = ContextKV([(k, k.clone())], lens=[5, 3])
    assert ctx.capacity == 64
    reference = [k[0, :, :5], k[1, :, :3]]
    caps = set()
    for step in range(60):
        new = torch.randn(2, 2, 3, 4)
        counts = [step % 4 if step % 4 < 3 else 3, 1]
        ctx.append([(new, new.clone())], counts)
        reference = [torch.cat([reference[i], new[i, :, :counts[i]]], 1) for i in range(2)]
        caps.add(ctx.capacity)
    views = ctx.views()[0][0]
    for i in range(2):
        assert torch.equal(views[i, :, :ctx.lens[i]], reference[i])
    assert max(caps) < 4 * max(ctx.lens) and len(caps) <= 4  # doubling: few reallocations
    ctx.keep([1])
    assert ctx.lens == [reference[1].shape[1]] and torch.equal(ctx.views()[0][0][0, :, :ctx.lens[0]], reference[1])


def test_target_topk_is_filled_only_when_asked(stacks):
    target, head, _ = stacks["qwen3"]
    drafter = make_drafter("jetflow", head)
    prompt = [5, 6, 7, 5, 6, 7]
    plain = list(generate(target, drafter, prompt, max_new_tokens=6, budget=8))
    assert all(r.target_top is None for r in plain)
    rounds = list(generate(target, drafter, prompt, max_new_tokens=6, budget=8, target_topk=3))
    for r in rounds[1:]:
        ids, probs = r.target_top
        assert ids.shape == probs.shape == (len(r.tree), 3)
        assert bool((probs[:, :-1] >= probs[:, 1:]).all()) and float(probs.max()) <= 1.0
        # greedy: every accepted child is the target's top-1 at its parent
        for parent, child in zip(r.path, r.path[1:]):
            assert int(ids[parent, 0]) == r.tree.tokens[child]
    with pytest.raises(ValueError):
        list(generate(target, drafter, prompt, target_topk=-1))
