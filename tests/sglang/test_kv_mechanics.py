"""SGLang's KV mechanics under JETFLOW, on one pair of servers that has them all at once: a paged KV pool
(`--page-size 4`), forced retraction (SGLang's SGLANG_TEST_RETRACT: a running decode request is retracted every few
scheduler steps, its KV freed, and it prefills its prompt plus output again later, as when the pool runs short) and
streaming sessions (`--enable-streaming-session`). Default target with the shipped head, float32, JETFLOW synchronous
and on the overlap scheduler, against the session's plain synchronous reference (page size 1, no forced retraction):
every mechanism's test runs under the other two, a stronger setting than each alone (the three used to be separate
modules with a server pair each).

- Paged KV: a paged JETFLOW server died at its first decode (SGLang's speculative KV reservation looked up each
  request's last slot with a Triton kernel: cpu/paging.py). Greedy output equals plain's in mixed greedy + sampled
  batches, with trees spanning page boundaries and a radix-cache hit.
- Retraction: a retracted request comes back as if nothing happened: same tokens, logprobs and finish, with its
  grammar, penalties and min_new_tokens state intact (fixes/penalties.py).
- Streaming sessions: each turn continues on the KV its session kept from the last turn. A finished JETFLOW turn's
  last output token has a slot holding a draft node's KV, which SGLang's session kept as that token's
  (fixes/sessions.py), and later turns parted from plain."""
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
ARGS = ["--page-size", "4", "--max-running-requests", "8", "--enable-streaming-session"]
RETRACT = {"SGLANG_TEST_RETRACT": "True", "SGLANG_TEST_RETRACT_INTERVAL": "4"}  # JETFLOW servers only
MODES = ["sync", "overlap"]


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, ARGS, RETRACT)


def _retractions(srv) -> int:
    return srv.log.read_text(errors="replace").count("Testing retraction")


# -- paged KV ----------------------------------------------------------------------------------------------------
PAGED_PROMPTS = ["Write the alphabet: A B C D E F", "List three colors.", "What is 2 + 2?", "Name a fruit."]


@pytest.mark.parametrize("mode", MODES)
def test_paged_jetflow_matches_plain_in_mixed_batches(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    ids = chat_ids(target, PAGED_PROMPTS)
    greedy = [dict(input_ids=i, sampling_params={"max_new_tokens": 23, "temperature": 0, "ignore_eos": True})
              for i in ids]
    sampled = [dict(input_ids=i, sampling_params={"max_new_tokens": 23, "temperature": 0.8, "top_p": 0.9,
                                                  "ignore_eos": True}) for i in ids[:2]]
    for _ in range(2):  # the second pass hits the radix cache
        with cf.ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda b: spec.generate(**b), greedy + sampled))
        for body, a in zip(greedy, got):
            assert a["output_ids"] == plain.generate(**body)["output_ids"], body
        assert all(len(a["output_ids"]) == 23 for a in got[len(greedy):])
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got[:len(greedy)]) < 4 * 22  # drafts were accepted


# -- retraction --------------------------------------------------------------------------------------------------
RETRACT_PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.",
                   "Write a sentence about the sea.", "What is 12 times 7?"]
KINDS = [{"max_new_tokens": 48, "ignore_eos": True},
         {"max_new_tokens": 32, "frequency_penalty": 0.7},
         {"max_new_tokens": 32, "repetition_penalty": 1.3},
         {"max_new_tokens": 24, "regex": r"[0-9]{1,4}(, [0-9]{1,4}){0,5}\."},
         {"max_new_tokens": 32, "min_new_tokens": 28},
         {"max_new_tokens": 32, "logit_bias": {"28": 3.0}}]


@pytest.mark.parametrize("mode", MODES)
def test_retracted_requests_finish_as_plain(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    ids = chat_ids(target, RETRACT_PROMPTS)
    bodies = [dict(input_ids=ids[i % len(ids)], return_logprob=True,
                   sampling_params={"temperature": 0, **KINDS[i % len(KINDS)]}) for i in range(12)]
    sampled = [dict(input_ids=i, sampling_params={"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.9,
                                                  "ignore_eos": True}) for i in ids[:2]]
    before = _retractions(spec)
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: spec.generate(**b), bodies + sampled))
    assert _retractions(spec) > before  # retractions happened during these requests
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


# -- streaming sessions ------------------------------------------------------------------------------------------
SESSION_PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.", "What is 12 times 7?",
                   "Write a sentence about the sea."]
TURNS = ["And double it?", "Thanks. Now say it in words.", "One more time, briefly."]


def _conversation(srv, first: list[int], turns: list[list[int]]) -> list[list[int]]:
    sid = srv.post("/open_session", {"capacity_of_str_len": 8000, "streaming": True}).json()
    try:
        outs = []
        for ids in [first, *turns]:
            out = srv.generate(input_ids=ids, session_params={"id": sid},
                               sampling_params={"max_new_tokens": 24, "temperature": 0})
            outs.append(out["output_ids"])
        return outs
    finally:
        requests.post(srv.url + "/close_session", json={"session_id": sid}, timeout=30)


@pytest.mark.parametrize("mode", MODES)
def test_streaming_session_turns_match_plain(servers, mode):
    from transformers import AutoTokenizer

    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    tok = AutoTokenizer.from_pretrained(target)
    firsts = chat_ids(target, SESSION_PROMPTS)
    turns = [tok(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
             for t in TURNS]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda f: _conversation(spec, f, turns), firsts))
    for first, conv in zip(firsts, got):
        assert conv == _conversation(plain, first, turns), tok.decode(first)
    assert all(len(t) > 0 for conv in got for t in conv)
