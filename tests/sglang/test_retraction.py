"""Retraction: when the KV pool runs short, SGLang retracts running decode requests (frees their KV and re-queues them;
they prefill their prompt plus output again later). A JETFLOW request must come back as if nothing happened: same
tokens, same logprobs, same finish, with its grammar, penalties and min_new_tokens state intact. SGLang's
SGLANG_TEST_RETRACT forces a retraction every few scheduler steps (its own cache-consistency tests use it); the
reference is the plain synchronous server without forced retraction, on the default target with the shipped head."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import torch

from tests.sglang.sgl_server import chat_ids, default_target_servers

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
ARGS = ["--max-running-requests", "8"]
RETRACT = {"SGLANG_TEST_RETRACT": "True", "SGLANG_TEST_RETRACT_INTERVAL": "4"}  # JETFLOW servers only
PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.",
           "Write a sentence about the sea.", "What is 12 times 7?"]
KINDS = [{"max_new_tokens": 48, "ignore_eos": True},
         {"max_new_tokens": 32, "frequency_penalty": 0.7},
         {"max_new_tokens": 32, "repetition_penalty": 1.3},
         {"max_new_tokens": 24, "regex": r"[0-9]{1,4}(, [0-9]{1,4}){0,5}\."},
         {"max_new_tokens": 32, "min_new_tokens": 28},
         {"max_new_tokens": 32, "logit_bias": {"28": 3.0}}]


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, ARGS, RETRACT)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_retracted_requests_finish_as_plain(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    ids = chat_ids(target, PROMPTS)
    bodies = [dict(input_ids=ids[i % len(ids)], return_logprob=True,
                   sampling_params={"temperature": 0, **KINDS[i % len(KINDS)]}) for i in range(12)]
    sampled = [dict(input_ids=i, sampling_params={"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.9,
                                                  "ignore_eos": True}) for i in ids[:2]]
    before = spec.log.read_text().count("Testing retraction")
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: spec.generate(**b), bodies + sampled))
    assert spec.log.read_text().count("Testing retraction") > before  # retractions happened during these requests
    for body, a in zip(bodies, got):
        b = plain.generate(**body)
        assert a["output_ids"] == b["output_ids"], body["sampling_params"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"], body["sampling_params"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in la] == [t for _, t, _ in lb]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3, body["sampling_params"]
    assert all(len(a["output_ids"]) == 32 for a in got[len(bodies):])
    spec_tokens = sum(len(a["output_ids"]) for a in got[:len(bodies)])
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got[:len(bodies)]) < spec_tokens  # drafts were accepted
