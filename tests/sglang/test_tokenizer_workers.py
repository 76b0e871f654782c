"""`--tokenizer-worker-num 2` (SGLang's multi-tokenizer mode: uvicorn spawns the HTTP tokenizer workers). SGLang 0.5.23
does not load plugins in those workers, so a JETFLOW server did not start ("Unknown speculative algorithm name:
JETFLOW"). Now it starts (the hand-over in fixes/request_guard.py), synchronous and on the overlap scheduler; in a mixed greedy + sampled
load its greedy output equals HF's (float32), and the request guard answers in the workers: out-of-vocabulary ids and
unbounded `n` get 400s, over fresh connections, and the server stays up."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import requests
import torch

from tests.sglang.sgl_fixtures import hf_greedy, tiny_jetflow_server

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "def fib(n):", "1 2 3 4 5", "Once upon a time"]
NEW = 16
BAD_CHAT_BODY = {"model": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 1000}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """On the overlap scheduler only: tokenizer workers sit in front of the scheduler and never see its mode (a
    synchronous twin of this server ran here until 2026-12-07)."""
    for srv, target in tiny_jetflow_server(tmp_path_factory.mktemp("tokw"), "Qwen3", 6, "--tokenizer-worker-num", "2",
                                           env={"JETFLOW_OVERLAP": "on"}, spawn=True):
        yield srv, str(target)


def test_multi_tokenizer_server_serves_jetflow_identical_to_hf(setup):
    from transformers import AutoTokenizer

    srv, target = setup
    tok = AutoTokenizer.from_pretrained(target)
    ids = [tok(p).input_ids for p in PROMPTS]
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    sampled = {"max_new_tokens": NEW, "temperature": 0.9, "ignore_eos": True}
    bodies = [(i, sp) for i in ids + ids] + [(i, sampled) for i in ids[:2]]  # one mixed greedy + sampled load
    with cf.ThreadPoolExecutor(4) as ex:  # separate connections: uvicorn spreads them over the workers
        got = list(ex.map(lambda b: srv.generate(input_ids=b[0], sampling_params=b[1]), bodies))
    for (i, params), out in zip(bodies, got):
        if params is sp:
            assert out["output_ids"] == hf_greedy(target, i, NEW, stop_at_eos=False)
        assert len(out["output_ids"]) == NEW
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in got)
    chat = requests.post(srv.url + "/v1/chat/completions", json={"model": "x", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=120)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0


def test_request_guard_answers_in_every_tokenizer_worker(setup):
    srv, _ = setup
    vocab = requests.get(srv.url + "/model_info", timeout=30).json().get("vocab_size") or 10**6
    for _ in range(8):  # a new connection each time
        with requests.Session() as s:
            r = s.post(srv.url + "/generate", json={"input_ids": [1, 2, vocab + 5], "sampling_params": {
                "max_new_tokens": 4}}, timeout=60)
            assert r.status_code == 400, r.text
        with requests.Session() as s:  # n above the guard's limit: SGLang 0.5.23 would queue all 1000
            r = s.post(srv.url + "/v1/chat/completions", json=BAD_CHAT_BODY, timeout=60)
            assert r.status_code == 400 and "n = " in r.text, r.text
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200
    assert srv.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})["output_ids"]
