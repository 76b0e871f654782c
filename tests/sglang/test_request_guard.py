"""The server survives any single request: empty prompts, token ids outside the vocabulary, request bodies that
are not JSON objects and input_embeds it cannot take get a 4xx from a real JETFLOW server on 127.0.0.1, and /health
stays 200 after each."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests

from types import SimpleNamespace

from jetflow_sglang.sglang.fixes.request_guard import (MAX_N, body_is_non_object_json, check_input_embeds, check_input_ids,
                                                 check_limits, raised_validating_body)

from tests.sglang.sgl_fixtures import tiny_jetflow_server  # noqa: E402


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


@pytest.mark.parametrize("body,bad", [(b"[1, 2]", True), (b'"hi"', True), (b"null", True), (b"3", True),
                                      (b"{}", False), (b'{"a": 1}', False), (b"not json", False), (b"", False)])
def test_body_check(body, bad):
    assert body_is_non_object_json(body) is bad


def test_only_crashes_inside_body_validation_count_as_client_errors():
    def request_body_to_args():  # same name as FastAPI's body validation step
        return {}.get(1).get("x")

    with pytest.raises(AttributeError) as inside:
        request_body_to_args()
    with pytest.raises(AttributeError) as outside:
        None.get("x")
    assert raised_validating_body(inside.value) and not raised_validating_body(outside.value)


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
    ("/generate", "[1, 2]"),
    ("/v1/completions", '{"model": "default", "prompt": ""}'),
    ("/v1/completions", '{"model": "default", "prompt": [5, 70000]}'),
    ("/v1/completions", "[1]"),
    ("/v1/chat/completions", "[1, 2]"),
    ("/v1/chat/completions", '"hello"'),
    ("/v1/chat/completions", "null"),
    ("/v1/chat/completions", '{"model": "default", "messages": "hi"}'),
    ("/v1/chat/completions", '{"model": "default", "messages": [1]}'),
    ("/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": "x"}], '
                             '"response_format": "abc", "max_tokens": 2}'),
    # limits SGLang does not check (section 3 of request_guard): each of these took a scheduler down
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
    # input_embeds (section 4): a wrong or uneven row width ended the scheduler; a float32 model fails on any
    ("/generate", '{"input_embeds": [[0.5, 0.5]], "sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", json.dumps({"input_embeds": [[0.5] * HIDDEN, [0.5] * 3], "sampling_params": {"max_new_tokens": 2}})),
    ("/generate", json.dumps({"input_embeds": [[0.5] * HIDDEN] * 2, "sampling_params": {"max_new_tokens": 2}})),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for srv, _ in tiny_jetflow_server(tmp_path_factory.mktemp("rg"), "Qwen3", 4, "--disable-radix-cache", spawn=True):
        yield srv


def _health(srv) -> int:
    return requests.get(srv.url + "/health", timeout=60).status_code


@pytest.mark.slow
def test_bad_requests_get_4xx_and_the_server_stays_up(server):
    for path, raw in BAD:
        r = requests.post(server.url + path, data=raw, headers={"content-type": "application/json"}, timeout=120)
        assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text[:300])
        assert _health(server) == 200, (path, raw, server.tail())
    ok = server.generate(text="The quick brown fox", sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert len(ok["output_ids"]) == 8 and ok["meta_info"]["spec_verify_ct"] > 0
    assert "Traceback" not in Path(server.log).read_text(errors="replace")


@pytest.mark.slow
def test_error_messages_name_the_problem(server):
    r = server.post("/generate", {"input_ids": [1, 2, 60000]})
    assert "60000" in r.json()["error"]["message"]
    r = server.post("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -5})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/chat/completions", data=json.dumps([1]),
                      headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "JSON object" in r.json()["message"]
    r = server.post("/generate", {"input_embeds": [[0.5] * HIDDEN], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "--dtype bfloat16" in r.json()["error"]["message"]
