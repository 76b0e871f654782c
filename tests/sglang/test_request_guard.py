"""The server survives any single request: empty prompts, token ids outside the vocabulary, unbounded limits and
input_embeds it cannot take get a 4xx from a real JETFLOW server on 127.0.0.1, and /health stays 200 after each;
request bodies that are not JSON objects get the same answer as from a plain SGLang server (its own 500, the server
up)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests

from types import SimpleNamespace

from jetflow_sglang.sglang.fixes.request_guard import MAX_N, check_input_embeds, check_input_ids, check_limits

from tests.sglang.sgl_fixtures import shared_tiny, tiny_jetflow_server  # noqa: E402
from tests.sglang.sgl_server import plain_tiny  # noqa: E402


# -- unit: the checks themselves ------------------------------------------------------------------------------
@pytest.mark.parametrize("ids,ok", [([1, 2, 3], True), ([0, 375], True), ([], False), ([1, 376], False),
                                    ([-1], False), ([1.5], False), ([True], False), (None, True)])
def test_check_input_ids(ids, ok):
    if ok:
        check_input_ids(ids, 376)
    else:
        with pytest.raises(ValueError) as e:
            check_input_ids(ids, 376)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("params,extra,field", [
    ({"top_k": 10**12}, {}, "top_k"), ({"top_k": -2}, {}, "top_k"), ({"n": MAX_N + 1}, {}, "n ="),
    ({}, {"logprob_start_len": -5}, "logprob_start_len"), ({}, {"top_logprobs_num": 377}, "top_logprobs_num"),
    ({"top_k": -1}, {}, None), ({"top_k": 2**31 - 1}, {}, None), ({"top_k": 5000}, {}, None), ({"n": MAX_N}, {}, None),
    ({}, {"logprob_start_len": -1}, None), ({}, {"logprob_start_len": 0}, None), ({}, {"top_logprobs_num": 376}, None)])
def test_check_limits(params, extra, field):
    obj = SimpleNamespace(sampling_params=params, logprob_start_len=-1, top_logprobs_num=0)
    obj.__dict__.update(extra)
    if field is None:
        check_limits(obj, 376)
    else:
        with pytest.raises(ValueError) as e:
            check_limits(obj, 376)
        assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("embeds,dtype,field", [
    ([[0.0] * 8] * 3, "torch.bfloat16", None), (None, "torch.float32", None), ([], "torch.bfloat16", "empty"),
    ([[0.0] * 7], "torch.bfloat16", "has 7 values"), ([[0.0] * 8, [0.0] * 9], "torch.bfloat16", "input_embeds[1]"),
    ([0.5, 0.5], "torch.bfloat16", "has float values"), ([[0.0] * 8], "torch.float32", "float32"),
    ([[0.0] * 8], "torch.float16", "float16")])
def test_check_input_embeds(embeds, dtype, field):
    if field is None:
        check_input_embeds(embeds, 8, dtype)
    else:
        with pytest.raises(ValueError) as e:
            check_input_embeds(embeds, 8, dtype)
        assert field in str(e.value) and "\n" not in str(e.value)


# -- against a real server ------------------------------------------------------------------------------------
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

HIDDEN = 64  # the tiny target's hidden size (sgl_fixtures)
BAD = [  # (path, raw JSON body)
    ("/generate", '{"text": ""}'),
    ("/generate", '{"input_ids": []}'),
    ("/generate", '{"input_ids": [1, 2, 60000]}'),
    ("/generate", '{"input_ids": [1, -2]}'),
    ("/generate", '{"text": ["hi", ""]}'),
    ("/generate", '{"input_ids": [[1, 2], [3, 999]]}'),
    ("/v1/completions", '{"model": "default", "prompt": ""}'),
    ("/v1/completions", '{"model": "default", "prompt": [5, 70000]}'),
    ("/v1/chat/completions", '{"model": "default", "messages": "hi"}'),
    ("/v1/chat/completions", '{"model": "default", "messages": [1]}'),
    # limits SGLang does not check (section 2 of request_guard): each of these took a scheduler down
    ("/generate", '{"text": "hi", "sampling_params": {"top_k": 1000000000000, "max_new_tokens": 2}}'),
    ("/generate", '{"text": "hi", "return_logprob": true, "logprob_start_len": -5, '
                  '"sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", '{"text": "hi", "return_logprob": true, "top_logprobs_num": 100000, '
                  '"sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"n": 1000, "max_new_tokens": 2, "temperature": 0.5}}'),
    ("/v1/completions", '{"model": "default", "prompt": "hi", "max_tokens": 2, "top_k": 1000000000000}'),
    ("/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, '
                             '"logprobs": true, "top_logprobs": 100000}'),
    ("/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, '
                             '"n": 1000}'),
    # input_embeds (section 3): a wrong or uneven row width ended the scheduler; a float32 model fails on any
    ("/generate", '{"input_embeds": [[0.5, 0.5]], "sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", json.dumps({"input_embeds": [[0.5] * HIDDEN, [0.5] * 3], "sampling_params": {"max_new_tokens": 2}})),
    ("/generate", json.dumps({"input_embeds": [[0.5] * HIDDEN] * 2, "sampling_params": {"max_new_tokens": 2}})),
]
# Bodies SGLang itself answers with a 500 and survives (not JSON objects, or a nested value that crashes FastAPI's
# body validation): a JETFLOW server answers them exactly as a plain one.
SGLANG_OWN = [
    ("/generate", "[1, 2]"),
    ("/v1/completions", "[1]"),
    ("/v1/chat/completions", "[1, 2]"),
    ("/v1/chat/completions", '"hello"'),
    ("/v1/chat/completions", "null"),
    ("/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": "x"}], '
                             '"response_format": "abc", "max_tokens": 2}'),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for srv, _ in tiny_jetflow_server(tmp_path_factory.mktemp("rg"), "Qwen3", 4, "--disable-radix-cache"):
        yield srv


def _health(srv) -> int:
    return requests.get(srv.url + "/health", timeout=60).status_code


def _post_raw(srv, path: str, raw: str) -> requests.Response:
    return requests.post(srv.url + path, data=raw, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_server_stays_up(server):
    for path, raw in BAD:
        r = _post_raw(server, path, raw)
        assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text[:300])
        assert _health(server) == 200, (path, raw, server.tail())
    ok = server.generate(text="The quick brown fox", sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert len(ok["output_ids"]) == 8 and ok["meta_info"]["spec_verify_ct"] > 0
    assert "Traceback" not in Path(server.log).read_text(errors="replace")


@pytest.mark.slow
def test_bodies_sglang_answers_itself_get_the_plain_servers_answer(server, server_pool):
    with server_pool.use(plain_tiny(server_pool, shared_tiny())) as (plain,):
        for path, raw in SGLANG_OWN:
            got, want = _post_raw(server, path, raw), _post_raw(plain, path, raw)
            assert got.status_code == want.status_code, (path, raw, got.status_code, want.status_code, got.text[:300])
            assert _health(server) == 200, (path, raw, server.tail())


@pytest.mark.slow
def test_error_messages_name_the_problem(server):
    r = server.post("/generate", {"input_ids": [1, 2, 60000]})
    assert "60000" in r.json()["error"]["message"]
    r = server.post("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -5})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]
    r = server.post("/generate", {"input_embeds": [[0.5] * HIDDEN], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "--dtype bfloat16" in r.json()["error"]["message"]
