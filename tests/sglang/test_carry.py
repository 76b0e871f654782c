"""The carry between rounds (verify_input.JetFlowCarry): one row per request, so SGLang's filter/merge keep each
request's anchor and length whatever tree sizes the rounds before used (the NgramVerifyInput carry it replaced
reshaped `accept_tokens` by one round's stride)."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed", allow_module_level=True)
from jetflow_sglang.sglang.cpu import ops as cpu_ops  # noqa: E402

cpu_ops.install()
from jetflow_sglang.sglang.verify_input import JetFlowCarry  # noqa: E402


def test_merge_then_filter_keeps_each_requests_row():
    a = JetFlowCarry(torch.tensor([11, 12]), torch.tensor([5, 6]))  # a running batch whose last round used 4 nodes
    b = JetFlowCarry(torch.tensor([13]), torch.tensor([9]))  # a new request from prefill (any budget)
    a.merge_batch(b)
    a.filter_batch(torch.tensor([0, 2]))  # request 1 finished
    assert a.bonus_tokens.tolist() == [11, 13] and a.new_seq_lens.tolist() == [5, 9]


def test_under_overlap_only_the_relay_indices_move():
    a = JetFlowCarry(torch.tensor([1, 2]), torch.tensor([3, 4]), future_indices=torch.tensor([7, 8]))
    a.merge_batch(JetFlowCarry(torch.tensor([5]), torch.tensor([6]), future_indices=torch.tensor([9])))
    a.filter_batch(torch.tensor([2, 0]))
    assert a.future_indices.tolist() == [9, 7]


def test_sglangs_relay_reads_the_carry():
    """SGLang's FutureMap stashes an EAGLE-shaped payload from the carry: the bonus token, nothing else."""
    from sglang.srt.managers.overlap_utils import RelayPayload

    p = RelayPayload.from_draft_input(JetFlowCarry(torch.tensor([4, 5]), torch.tensor([1, 2])))
    assert p.bonus_tokens.tolist() == [4, 5] and p.topk_p is None and p.hidden_states is None


def test_the_carry_it_replaced_breaks_under_auto():
    """Why the carry changed: SGLang's NgramVerifyInput (JETFLOW's carry before) flattens accept_tokens at each
    round's stride and reshapes by its own draft_token_num on filter. Under `auto` with a budget of 6 (ladder 0, 1,
    2, 4, 6), a running request whose last round used 4 nodes merged with a new one (prefill carry: 6) holds 10
    entries, and filtering them by a stride of 4 raises inside the scheduler."""
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    running = NgramVerifyInput(draft_token_num=4, new_seq_lens=torch.tensor([5]), accept_tokens=torch.arange(4),
                               accept_lens=torch.tensor([2]))
    running.merge_batch(NgramVerifyInput(draft_token_num=6, new_seq_lens=torch.tensor([9]),
                                         accept_tokens=torch.arange(6), accept_lens=torch.tensor([1])))
    with pytest.raises(RuntimeError):
        running.filter_batch(torch.tensor([1]))
