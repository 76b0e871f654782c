"""Penalties per tree path (jetflow_sglang.sglang.fixes.penalties.penalise) against a brute-force walk of every node's path
(the request's output tokens + the drafted tokens on the node's path). The server-level check against HF is in
test_sglang_server.py (test_penalties_per_path_match_hf_and_plain)."""
from __future__ import annotations

import types

import torch

from jetflow_sglang.sglang.fixes.penalties import penalise
from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.core.tree_batch import TreeBatch

V = 12
STOP = 11


STOPS = [{7, STOP}, {9, STOP}]  # what min_new_tokens bans per request: stop_token_ids, EOS ids, the tokenizer's


def _batch(committed: list[list[int]], freq, pres, rep, min_new):
    """A ScheduleBatch as SGLang hands it to a speculative worker: requests with output_ids, sampling params and their
    stop tokens (request 0: stop_token_ids and EOS ids; request 1: the tokenizer's EOS and additional stop ids), and
    a forward copy of the sampling info, which carries no penalizer state."""
    reqs = []
    for i, (c, f, p, r, m) in enumerate(zip(committed, freq, pres, rep, min_new)):
        sp = types.SimpleNamespace(frequency_penalty=f, presence_penalty=p, repetition_penalty=r, min_new_tokens=m,
                                   stop_token_ids={7} if i == 0 else None)
        tokenizer = types.SimpleNamespace(eos_token_id=STOP, additional_stop_token_ids={9}) if i else None
        reqs.append(types.SimpleNamespace(output_ids=list(c), sampling_params=sp, tokenizer=tokenizer,
                                          eos_token_ids={STOP} if i == 0 else None))
    info = types.SimpleNamespace(penalizer_orchestrator=None, logit_bias=None)
    return types.SimpleNamespace(reqs=reqs, sampling_info=info)


def _reference(logits, committed, tree: DraftTree, f, p, r, min_new, stops):
    out = logits.clone()
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)[1:]]
        seen = committed + path
        row = out[node]
        for t in set(seen):
            row[t] -= f * seen.count(t) + p
        if len(committed) + tree.depths[node] < min_new:
            row[sorted(stops)] = float("-inf")
        for t in set(seen):
            row[t] = row[t] * r if row[t] < 0 else row[t] / r
    return out


def _trees():
    a = DraftTree.root(3)
    x = a.add(5, 0, -0.1)
    a.add(3, x, -0.2)
    y = a.add(7, 0, -0.3)
    a.add(5, y, -0.4)
    b = DraftTree.root(1)
    b.add(1, 0, -0.1)
    return [a, b]


def test_every_node_is_penalised_with_its_own_path():
    torch.manual_seed(0)
    trees = _trees()
    committed = [[3, 4, 4], [1]]
    f, p, r, mn = [0.5, 1.0], [0.3, 0.0], [1.3, 1.7], [5, 3]
    tb = TreeBatch.from_trees(trees, budget=6)
    logits = torch.randn(2 * 6, V) * 3
    got = penalise(logits, _batch(committed, f, p, r, mn), tb).view(2, 6, V)
    for i, t in enumerate(trees):
        ref = _reference(logits.view(2, 6, V)[i, :len(t)], committed[i], t, f[i], p[i], r[i], mn[i], STOPS[i])
        torch.testing.assert_close(got[i, :len(t)], ref)


def test_no_penalties_no_copy():
    tb = TreeBatch.from_trees(_trees(), budget=6)
    logits = torch.randn(12, V)
    assert penalise(logits, _batch([[3], [1]], [0.0] * 2, [0.0] * 2, [1.0] * 2, [0, 0]), tb) is logits


class _Batch:  # SGLang's orchestrator holds its batch by weak reference
    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def test_retracted_request_prefills_with_its_history():
    """A request SGLang retracted prefills its prompt plus output again. Its penalizers, prepared with
    install_prefill_history, hold what SGLang's penalizers hold when fed that output token by token without a
    retraction; a request without output is prepared as before."""
    import pytest

    pl = pytest.importorskip("sglang.srt.sampling.penaltylib")
    from sglang.srt.sampling.penaltylib.orchestrator import _BatchedPenalizer

    from jetflow_sglang.sglang.fixes.penalties import install_prefill_history

    kinds = {pl.BatchedFrequencyPenalizer, pl.BatchedPresencePenalizer, pl.BatchedRepetitionPenalizer,
             pl.BatchedMinNewTokensPenalizer}
    outputs = [[3, 4, 4, 9, 3], [1, 1, 5, 2, 0], []]  # two retracted requests, one fresh

    def reqs(with_output: bool):
        out = []
        for i, o in enumerate(outputs):
            sp = types.SimpleNamespace(frequency_penalty=[0.5, 0.0, 0.3][i], presence_penalty=[0.2, 0.7, 0.0][i],
                                       repetition_penalty=[1.3, 1.1, 1.2][i], min_new_tokens=[7, 3, 2][i],
                                       stop_token_ids={STOP})
            out.append(types.SimpleNamespace(output_ids=list(o) if with_output else [], sampling_params=sp,
                                             eos_token_ids=None, tokenizer=types.SimpleNamespace(
                                                 eos_token_id=None, additional_stop_token_ids=None)))
        return out

    original = _BatchedPenalizer.prepare
    try:
        install_prefill_history()
        seeded_batch = _Batch(reqs(True))
        seeded = pl.BatchedPenalizerOrchestrator(V, seeded_batch, kinds)
    finally:
        _BatchedPenalizer.prepare = original
    fed_batch = _Batch(reqs(False))
    fed = pl.BatchedPenalizerOrchestrator(V, fed_batch, kinds)
    for k in range(len(outputs[0])):  # SGLang's own path: one token per step (the fresh request's row is not compared)
        fed.cumulate_output_tokens(torch.tensor([o[k] if o else 0 for o in outputs]))
    logits = torch.randn(3, V) * 3
    a, b = logits.clone(), logits.clone()
    seeded.apply(a)
    fed.apply(b)
    torch.testing.assert_close(a[:2], b[:2])
    plain = logits[2:].clone()
    pl.BatchedPenalizerOrchestrator(V, _Batch(reqs(False)[2:]), kinds).apply(plain)
    torch.testing.assert_close(a[2:], plain)  # no output: as SGLang prepares it
    assert not torch.equal(a[:2], logits[:2])
