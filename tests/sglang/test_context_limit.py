"""Requests that run to the context length, on the default target with the shipped head (`--context-length 96`,
budget 16), synchronous and on the overlap scheduler, against the plain server.

A JETFLOW server died when a request came within a few tokens of its context length: SGLang reserves twice the draft
tokens of KV per request and step, and its req_to_token rows had room for num_draft_tokens + 4 past the context, so
the reservation wrote past the row (memory.install_row_headroom widens them). Near the end the worker also shrinks
the round's tree so that no node sits at a position plain decoding could not reach (worker._room)."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import requests
import torch

from tests.sglang.sgl_server import chat_ids, default_target_servers

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
CTX = 96  # the chat-templated prompts take about 35: each request decodes about 60 tokens to the end
PROMPTS = ["Count from one to one hundred in words.", "Write a long poem about the sea.",
           "List the multiples of seven.", "Describe a city at night."]


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, ["--context-length", str(CTX)], {},
                                      ["--disable-overlap-schedule"], budget=16)


def _bodies(ids):
    greedy = {"temperature": 0, "ignore_eos": True}
    return [
        dict(input_ids=ids[0], sampling_params=greedy),  # no max_new_tokens: up to the context length
        dict(input_ids=ids[1], sampling_params={**greedy, "max_new_tokens": CTX - len(ids[1])}),  # exactly to it
        dict(input_ids=ids[2], sampling_params={**greedy, "max_new_tokens": CTX - len(ids[2]) - 1},
             return_logprob=True),
        dict(input_ids=ids[3], sampling_params={"temperature": 0.8, "top_p": 0.9, "ignore_eos": True}),  # sampled
    ]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_requests_run_to_the_context_length_as_on_plain(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    bodies = _bodies(chat_ids(target, PROMPTS))
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        got = list(ex.map(lambda b: spec.generate(**b), bodies))
    want = [plain.generate(**b) for b in bodies]
    for body, a, b in zip(bodies, got, want):
        total = len(body["input_ids"]) + len(a["output_ids"])
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"], body["sampling_params"]
        assert total == len(body["input_ids"]) + len(b["output_ids"]) >= CTX - 2  # plain stops 2 short without max_new_tokens
    for a, b in zip(got[:3], want[:3]):
        assert a["output_ids"] == b["output_ids"]
    lp = [x[0] for x in got[2]["meta_info"]["output_token_logprobs"]]
    assert lp == pytest.approx([x[0] for x in want[2]["meta_info"]["output_token_logprobs"]], abs=1e-3)
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got[:3]) < sum(len(a["output_ids"]) for a in got[:3]) * 0.8

    # the chat route without max_tokens runs to the context length too; a request past it is refused, as on plain
    chat = {"model": "default", "messages": [{"role": "user", "content": PROMPTS[1]}], "temperature": 0,
            "ignore_eos": True}
    a, b = (requests.post(s.url + "/v1/chat/completions", json=chat, timeout=300).json() for s in (spec, plain))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"] == "length"
    over = dict(input_ids=bodies[0]["input_ids"], sampling_params={"max_new_tokens": CTX})
    assert spec.post("/generate", over).status_code == plain.post("/generate", over).status_code == 400
    assert requests.get(spec.url + "/health", timeout=30).ok


def test_near_the_context_end_no_tree_node_passes_plain_decodings_last_position():
    """A chain (the deepest tree a budget allows) of the worker's budget, placed as the verify places it, stays at
    or below position CTX - 2, plain decoding's last input; far from the end the budget is untouched."""
    from jetflow_sglang.sglang.cpu import ops as cpu_ops

    cpu_ops.install()  # SGLang's CPU stand-ins, before the worker imports SGLang's model code
    from jetflow_sglang.sglang.verify_input import verify_tensors
    from jetflow_sglang.sglang.worker import JetFlowWorker

    worker = object.__new__(JetFlowWorker)
    worker.context_len = CTX
    assert worker._room(CTX - 40) >= 16
    for committed in range(CTX - 24, CTX - 1):
        n = min(16, worker._room(committed))
        depths = torch.arange(n)[None]
        parents = (depths - 1).clamp(min=0)
        tokens, anc = torch.zeros(1, n, dtype=torch.long), torch.ones(1, n, n, dtype=torch.bool).tril()
        positions = verify_tensors(tokens, parents, depths, torch.tensor([n]), anc, torch.tensor([committed]), False)[2]
        assert int(positions.max()) <= CTX - 2, committed
