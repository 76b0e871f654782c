"""The dispatch-level sync checker (host_syncs.py) and the round pieces it holds to zero, without a server.

The checker must see what the Python-level counter could not (boolean indexing, multinomial, repeat_interleave
without output_size: each a host wait inside PyTorch on a GPU), and the worker's sampled acceptance and its FULL
verify mask must run with none of them."""
from __future__ import annotations

import pytest
import torch

from jetflow_sglang.sglang.host_syncs import SyncCounter
from tests.sglang.test_accept import _info, _trees


def _count(fn, batch=4, budget=8):
    c = SyncCounter()
    with c.round(batch, False, False):
        c.tag(budget)
        fn()
    return c.rounds[-1]


@pytest.mark.parametrize("name,fn", [
    ("item", lambda x: x.sum().item()),
    ("item", lambda x: bool(x[0] > 0)),
    ("nonzero", lambda x: torch.where(x > 0)),
    ("boolean index", lambda x: x[x > 0]),
    ("boolean index", lambda x: x.clone().index_put_((x > 0,), torch.zeros(()))),
    ("repeat_interleave without output_size", lambda x: torch.repeat_interleave(x.long().abs() % 3)),
    ("multinomial", lambda x: torch.multinomial(x.abs() + 0.1, 1)),
    ("unique", lambda x: x.unique()),
    ("from Python data", lambda x: torch.tensor([1, 2])),
    ("from Python data", lambda x: torch.as_tensor([[0.5]])),
    ("tolist", lambda x: x.tolist()),
    ("cpu", lambda x: x.cpu()),
])
def test_each_kind_of_host_wait_is_flagged_with_its_site(name, fn):
    x = torch.randn(6)
    r = _count(lambda: fn(x))
    assert r["syncs"] >= 1 and any(k.startswith(name + " ") and "test_host_syncs.py:" in k for k in r["sites"]), r


def test_what_needs_no_wait_is_not_flagged():
    x = torch.randn(6)
    r = _count(lambda: (torch.repeat_interleave(torch.arange(3), 2, output_size=6), x.masked_fill(x > 0, 0.0),
                        x.clone().__setitem__((slice(None),), 1.0),  # a Python scalar: a fill
                        torch.where(x > 0, x, 0.0), x.sort(), x.argmax(), x.numpy()))
    assert r["syncs"] == 0 and r["ops"] > 0, r


def test_sampled_acceptance_and_the_full_mask_do_not_wait():
    """A mixed greedy/sampled batch of 4 on budget-8 trees: acceptance (exponential races, not multinomial) and the
    FULL verify mask (a scatter sized from host bounds, not a boolean index) flag nothing."""
    from jetflow_sglang.sglang.accept import accept_batch
    from jetflow_sglang.sglang.cpu import ops as cpu_ops

    cpu_ops.install()  # verify_input imports SGLang's spec modules (CPU shims)
    from jetflow_sglang.sglang.verify_input import verify_tensors

    tree = _trees(4, 8)
    logits = torch.randn(4 * tree.tokens.shape[1], 7)
    lens = torch.tensor([5, 9, 3, 7])
    g, info = torch.Generator().manual_seed(0), _info([0.0, 1.0, 0.7, 0.0])
    r = _count(lambda: (accept_batch(tree, logits, info, 3, g),
                        verify_tensors(tree.tokens, tree.parents, tree.depths, tree.sizes, tree.ancestor_mask(),
                                       lens, True, 9, 24)))
    assert r["syncs"] == 0, r["sites"]


def test_rounds_of_one_key_share_their_op_sequence_and_shapes_that_change_are_named():
    c = SyncCounter()
    for length in (5, 6, 5):
        with c.round(2, False, False):
            c.tag(4)
            torch.zeros(2, length).sum(1)
    with c.round(2, False, False):  # another key
        c.tag(8)
        torch.ones(3).cumsum(0)
    keys = c.snapshot()["keys"]
    assert keys["2x4"]["op_sequences"] == 1 and keys["2x4"]["shape_sequences"] == 2
    assert keys["2x4"]["ops_with_varying_shapes"] == ["aten.zeros.default"]
    assert keys["2x8"] == {"op_sequences": 1, "shape_sequences": 1, "ops_with_varying_shapes": []}


def test_a_blocking_copy_to_the_host_is_flagged_and_the_readback_copy_is_not():
    """On a GPU, `.cpu()` of a device tensor waits; readback.py's `non_blocking=True` copy behind an event does not
    (the meta device stands in for the GPU here: the decision reads only the devices and the flag)."""
    from jetflow_sglang.sglang.host_syncs import flag

    aten, dev = torch.ops.aten, torch.zeros(2, device="meta")
    assert flag(aten._to_copy.default, (dev,), {"device": torch.device("cpu")}) == "copy to the host"
    assert flag(aten.copy_.default, (torch.zeros(2), dev), {}) == "copy to the host"
    assert flag(aten._to_copy.default, (dev,), {"device": torch.device("cpu"), "non_blocking": True}) is None
    assert flag(aten.copy_.default, (torch.zeros(2), dev, True), {}) is None
    assert flag(aten._to_copy.default, (torch.zeros(2),), {"device": torch.device("meta")}) is None  # to the device
