"""Priority scheduling with preemption (`--enable-priority-scheduling`): a high-priority request that finds the running
batch full makes SGLang preempt a running low-priority one (its KV is freed and it is queued again; it later prefills
its prompt and output so far, and goes on). Under JETFLOW the preempted request may be mid-round, on the overlap
scheduler with a round in flight. Every request must still finish as on plain SGLang: same tokens, logprobs and
finish. The default target with the shipped head, two running slots, JETFLOW synchronous and on the overlap
scheduler, against the plain synchronous server."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import requests
import torch

from tests.sglang.sgl_server import chat_ids, default_target_servers

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
ARGS = ["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "1",
        "--max-running-requests", "2"]
PROMPTS = ["Write a sentence about the sea.", "List three colors.", "What is 12 times 7?",
           "Janet has 16 eggs and eats 3. How many are left?"]
LOW, HIGH = 0, 10


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, ARGS, {})


def _stream(srv, body: dict, progress: threading.Event, out: dict) -> None:
    """Streams body; sets progress once 4 tokens are out; out: the last chunk and the time it arrived."""
    with requests.post(srv.url + "/generate", json={**body, "stream": True}, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            out["last"], out["t"] = json.loads(line[5:]), time.monotonic()
            if out["last"]["meta_info"]["completion_tokens"] >= 4:
                progress.set()
    progress.set()


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_preempted_requests_finish_as_plain(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    ids = chat_ids(target, PROMPTS)
    low = [dict(input_ids=ids[0], priority=LOW, return_logprob=True,  # greedy, long
                sampling_params={"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}),
           dict(input_ids=ids[1], priority=LOW,  # sampled, long
                sampling_params={"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 96, "ignore_eos": True})]
    high = [dict(input_ids=i, priority=HIGH, return_logprob=True,
                 sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}) for i in ids[2:]]
    streams = [({}, threading.Event()) for _ in low]
    threads = [threading.Thread(target=_stream, args=(spec, b, ev, out)) for b, (out, ev) in zip(low, streams)]
    for t in threads:
        t.start()
    for _, ev in streams:  # both low-priority requests are decoding: the running batch (2) is full
        assert ev.wait(120)
    done = {}

    def run_high(i: int) -> None:
        done[i] = spec.generate(**high[i])
        done[f"t{i}"] = time.monotonic()

    highs = [threading.Thread(target=run_high, args=(i,)) for i in range(len(high))]
    for t in highs:
        t.start()
    for t in highs + threads:
        t.join(300)
    lows = [out["last"] for out, _ in streams]
    # preemption happened: each high-priority request finished while both long low-priority ones were still running
    assert all(done[f"t{i}"] < min(out["t"] for out, _ in streams) for i in range(len(high)))
    greedy = [(low[0], lows[0])] + [(high[i], done[i]) for i in range(len(high))]
    for body, a in greedy:
        b = plain.generate(**body)
        assert a["output_ids"] == b["output_ids"], body["sampling_params"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in la] == [t for _, t, _ in lb]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3
    assert len(lows[1]["output_ids"]) == 96  # the sampled one came back and finished too
    spec_tokens = sum(len(a["output_ids"]) for _, a in greedy)
    assert sum(a["meta_info"]["spec_verify_ct"] for _, a in greedy) < spec_tokens  # drafts were accepted
    assert requests.get(spec.url + "/health", timeout=30).ok
