"""Speculative sampling must reproduce the target's distribution exactly (checked statistically)."""
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from jetflow_sglang.draft.drafters import make_drafter, resample
from jetflow_sglang.engine.loop import run
from jetflow_sglang.engine.target import Target
from jetflow_sglang.core.tree import DraftTree, best_first, per_depth
from jetflow_sglang.core.verify import process_logits, sample_accept
from tests.helpers import tiny_head, tiny_model

torch.set_num_threads(1)
V = 6


def table(seed):
    """A synthetic target: p(. | path) for every token path, fixed by the seed."""
    cache = {}

    def p(path):
        if path not in cache:
            cache[path] = _dirichlet(torch.Generator().manual_seed(hash((seed,) + path) % 2**31))
        return cache[path]
    return p


def _dirichlet(g):
    x = (-torch.rand(V, generator=g, dtype=torch.float64).log()) ** 1.5
    return x / x.sum()


def draw_two(p_of, shape_fn, q, gen):
    """Emit two tokens with repeated speculative rounds on the synthetic target."""
    out = []
    while len(out) < 2:
        shape = shape_fn()
        tree = resample(shape, [q] * 16, gen) if q is not None else shape
        probs = torch.stack([p_of(tuple(out) + tuple(tree.tokens[i] for i in tree.path_to(n)[1:])) for n in range(len(tree))])
        path, bonus = sample_accept(tree, probs, gen)
        out += [tree.tokens[i] for i in path[1:]] + [bonus]
    return tuple(out[:2])


def joint(p_of):
    return {(a, b): float(p_of(())[a] * p_of((a,))[b]) for a, b in itertools.product(range(V), repeat=2)}


def chi2_pvalue(samples, expected):
    cells = sorted(expected)
    n = len(samples)
    obs = [sum(1 for s in samples if s == c) for c in cells]
    total = sum(expected[c] for c in cells)  # float32 softmax sums may miss 1 by ~1e-7
    return chisquare(obs, [expected[c] / total * n for c in cells]).pvalue


@pytest.mark.parametrize("mode", ["sampled-draft", "greedy-draft"])
def test_tree_rejection_sampling_matches_target(mode):
    p_of = table(1)
    gen = torch.Generator().manual_seed(0)
    q = _dirichlet(torch.Generator().manual_seed(5)).float()  # a draft that disagrees with the target
    rng = random.Random(0)
    cand = [list(range(V))] * 16
    lps = [[-0.1 * k for k in range(V)]] * 16

    def shape():  # random widths and depths
        return best_first(0, per_depth(cand, lps), rng.randint(1, 20), rng.randint(1, 4), 4)

    samples = [draw_two(p_of, shape, q if mode == "sampled-draft" else None, gen) for _ in range(12000)]
    assert chi2_pvalue(samples, joint(p_of)) > 1e-3


def test_the_check_catches_a_wrong_residual():
    """Accept with min(1, p/q) but resample from p itself on rejection (no residual): biased, and detected."""
    p, q = _dirichlet(torch.Generator().manual_seed(3)), _dirichlet(torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(12000):
        x = int(torch.multinomial(q, 1, generator=gen))
        keep = torch.rand((), generator=gen, dtype=torch.float64) < min(1.0, float(p[x] / q[x]))
        samples.append(x if keep else int(torch.multinomial(p, 1, generator=gen)))
    assert chi2_pvalue(samples, {i: float(p[i]) for i in range(V)}) < 1e-6
    # ...while the real rule passes on the same p, q
    tree = DraftTree.root(0)
    tree.add(0, 0, 0.0)
    right = []
    for _ in range(12000):
        t = resample(best_first(0, per_depth([list(range(V))], [[0.0] * V]), 3, 2, 1), [q.float()], gen)
        path, bonus = sample_accept(t, torch.stack([p] * len(t)), gen)
        right.append(t.tokens[path[1]] if len(path) > 1 else bonus)
    assert chi2_pvalue(right, {i: float(p[i]) for i in range(V)}) > 1e-3


@pytest.mark.parametrize("drafter_name", ["jetflow", "jetflow-branch", "ngram"])
def test_engine_sampling_matches_target(drafter_name):
    """End to end on a tiny-vocab model: the 2nd and 3rd tokens follow the target's processed distribution."""
    model = tiny_model("llama", vocab=V, seed=3, hidden=32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)  # soften back: every cell should be reachable
    target, head = Target(model), tiny_head(model)
    drafter = make_drafter(drafter_name, head)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    kw = dict(temperature=0.9, top_k=5, top_p=0.97)

    @torch.no_grad()
    def probs(seq):
        return process_logits(model(torch.tensor([seq])).logits[0, -1], **kw).double()

    exact = {}
    p1 = probs(prompt)
    for a in range(V):
        p2 = probs(prompt + [a])
        for b in range(V):
            p3 = probs(prompt + [a, b])
            for c in range(V):
                exact[(b, c)] = exact.get((b, c), 0.0) + float(p1[a] * p2[b] * p3[c])
    samples = [tuple(run(target, drafter, prompt, max_new_tokens=3, budget=8, seed=s, **kw).tokens[1:3]) for s in range(2500)]
    assert all(exact[s] > 0 for s in samples), "sampled a token that top-k/top-p removed"
    support = {c: v for c, v in exact.items() if v > 0}
    assert chi2_pvalue(samples, support) > 1e-3
