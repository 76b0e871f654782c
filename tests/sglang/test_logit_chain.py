"""logit_chain.custom_processors: each tree node's row goes to the request's custom logit processor with the request
as it would be after decoding the node's path (its output_ids extended, SGLang's array type kept), once per node."""
from __future__ import annotations

import types
from array import array

import torch

from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.core.tree_batch import TreeBatch
from jetflow_sglang.sglang.logit_chain import custom_processors

V = 10


class _Seen:
    """Writes, into each row, the length of the history it was given and its last token (a processor that reads
    `__req__`, as SGLang's thinking-budget and no-repeat-n-gram processors do)."""

    calls = 0

    def __call__(self, logits, params):
        _Seen.calls += 1
        for i, p in enumerate(params):
            ids = p["__req__"].origin_input_ids + p["__req__"].output_ids  # array + array, as those processors do
            logits[i, 0], logits[i, 1] = len(ids), ids[-1]
            assert p["__req__"].rid == p["rid"]  # everything else is the request's own
        return logits


def test_every_node_sees_its_own_path():
    a = DraftTree.root(3)
    x = a.add(5, 0, -0.1)
    a.add(6, x, -0.2)
    a.add(7, 0, -0.3)
    b = DraftTree.root(1)
    b.add(2, 0, -0.1)
    tb = TreeBatch.from_trees([a, b])
    n = tb.budget
    reqs = [types.SimpleNamespace(rid=f"r{i}", origin_input_ids=array("q", [9, 9]), output_ids=array("q", out))
            for i, out in enumerate([[4, 3], [8, 8, 1]])]
    params = [{"rid": r.rid, "__req__": r} for r in reqs]
    entry = types.SimpleNamespace(processor=_Seen(), rows=[0, 1])
    info = types.SimpleNamespace(custom_logit_processor={0: entry}, custom_params=params)
    batch = types.SimpleNamespace(reqs=reqs, sampling_info=info)
    logits = torch.zeros(2 * n, V)
    out = custom_processors(logits, batch, tb).view(2, n, V)
    for i, tree in enumerate([a, b]):
        for node in range(len(tree)):
            path = [tree.tokens[k] for k in tree.path_to(node)[1:]]
            history = [9, 9, *reqs[i].output_ids, *path]
            assert out[i, node, :2].tolist() == [len(history), history[-1]], (i, node)
    assert _Seen.calls == 1  # one call per processor and round, as plain SGLang's sampler makes
    assert list(reqs[0].output_ids) == [4, 3]  # the request itself is untouched
