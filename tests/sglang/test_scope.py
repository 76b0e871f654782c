"""Installing the package changes only JETFLOW servers. A plain server and an NGRAM server in this environment (the
plugin's entry point installed) must answer every request, and report /server_info, exactly as the same servers
with the plugin switched off by SGLang's own switch (SGLANG_PLUGINS naming another plugin). (NGRAM cannot serve on a
CPU without the plugin's tree backend, so its launch is compared instead: see NGRAM_STOCK.) The requests: greedy
generation with logprobs, the OpenAI routes at their defaults, n above the JETFLOW request guard's limit (which
plain SGLang serves), and bad bodies SGLang answers itself (a non-object JSON body, a body whose validation
crashes). The opt-in JETFLOW_GUARD_ALL=1 brings the guard to any server: the same plain server with
it refuses n above the limit with a 400, as a JETFLOW server does."""
from __future__ import annotations

import os
import re

import pytest
import requests
import torch

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)

from jetflow_sglang.sglang.fixes.request_guard import MAX_N  # noqa: E402
from tests.sglang.sgl_fixtures import shared_tiny  # noqa: E402
from tests.sglang.sgl_server import Server  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.slow
OFF = {"SGLANG_PLUGINS": "no-such-plugin"}  # SGLang loads only the plugins this names
PLAIN = ["--dtype", "float32"]
NGRAM = [*PLAIN, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", "--attention-backend",
         "jetflow_tree_native", "--max-running-requests", "4"]
# NGRAM on a CPU needs JetFlow's tree backend: SGLang's own torch_native backend cannot run NGRAM's verify forward,
# and without the plugin there is no other. So the NGRAM pair launches on torch_native, where both must end the same
# way (test_ngram_launch_ends_as_without_the_plugin); NGRAM serving on the plugin's backend is compared with plain
# decoding in test_sglang_server.
NGRAM_STOCK = [*NGRAM[:-3], "torch_native", *NGRAM[-2:]]
VOLATILE = ("port", "addr", "time", "throughput", "pid", "url", "host", "log", "dir", "uuid")
# /server_info fields that differ between two launches of one server: the random seed SGLang draws when none is
# given, the launch command (its port), and the memory the process found free at start-up
PER_LAUNCH = ("random_seed", "launch_command", "memory_usage")


def _requests(ids):
    """(route, body) pairs: good requests, then ones the JETFLOW guard answers differently from plain SGLang."""
    greedy = {"max_new_tokens": 12, "temperature": 0}
    return [
        ("/generate", {"input_ids": ids, "sampling_params": greedy, "return_logprob": True, "top_logprobs_num": 2}),
        ("/generate", {"text": "Once upon a time", "sampling_params": {**greedy, "stop": ["e"]}}),
        ("/v1/completions", {"model": "default", "prompt": "1 2 3 4", "max_tokens": 8, "temperature": 0,
                             "logprobs": 2}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 8, "temperature": 0}),
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                             "n": MAX_N + 2}}),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": "abc"}),
    ]


def _send(srv, route, body):
    if isinstance(body, bytes):
        r = requests.post(srv.url + route, data=body, headers={"content-type": "application/json"}, timeout=120)
    else:
        r = requests.post(srv.url + route, json=body, timeout=120)
    try:
        payload = r.json()
    except ValueError:
        payload = r.text
    return r.status_code, _strip(payload)


def _strip(value):
    """The answer without what differs between any two runs (ids, timestamps, timings, ports)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()
                if k not in ("id", "rid", "created", "e2e_latency", "response_sent_to_client_ts")
                and not any(w in k for w in VOLATILE)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _server_info(srv):
    def drop(value):
        if isinstance(value, dict):
            return {k: drop(v) for k, v in value.items() if k not in PER_LAUNCH}
        return [drop(v) for v in value] if isinstance(value, list) else value

    return drop(_strip(requests.get(srv.url + "/server_info", timeout=30).json()))


def _differences(a, b, where="") -> list[str]:
    """The paths at which two JSON values differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (_differences(a.get(k), b.get(k), f"{where}.{k}") if k in a and k in b
                          else [f"{where}.{k}: only {'with' if k in a else 'without'} the plugin"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_plain_server_answers_as_without_the_plugin(server_pool):
    from transformers import AutoTokenizer

    target = shared_tiny()
    # two fresh servers (the shared plain one has served other modules: its /server_info counters differ)
    on = server_pool.get(target, PLAIN, name="scope-on", shared=False, spawn=True)  # every process loads plugins
    off = server_pool.get(target, PLAIN, env=OFF, name="scope-off", shared=False, spawn=True)
    ids = AutoTokenizer.from_pretrained(target)("The quick brown fox").input_ids
    with server_pool.use(on, off):
        for route, body in _requests(ids):
            got, want = _send(on, route, body), _send(off, route, body)
            assert got == want, (route, body if not isinstance(body, dict) else list(body), got, want)
        n_status, n_body = _send(on, "/generate", _requests(ids)[4][1])
        assert n_status == 200 and len(n_body) == MAX_N + 2  # served: no guard in a plain server
        differences = _differences(_server_info(on), _server_info(off))
        assert not differences, "\n".join(differences)


def test_ngram_launch_ends_as_without_the_plugin(tmp_path):
    """NGRAM on SGLang's own CPU backend: with the package installed and without it, the launch ends in the same
    error, and no JETFLOW code runs in either. The error is the stock backend failing on NGRAM's verify forward, or,
    where the machine's free memory is short (a second test worker), SGLang's KV sizing refusal, whose numbers are
    the memory free at that launch and so are not compared."""
    target = shared_tiny()
    ends = []
    for name, env in (("on", {}), ("off", OFF)):
        srv = Server(str(target), NGRAM_STOCK, tmp_path / f"ngram-{name}.log", env=env)
        with pytest.raises(RuntimeError, match="exited"):
            srv.wait_ready()
        log = srv.log.read_text(errors="replace")
        # the exception lines (SGLang's crash diagnostics may log a "Pyspy failed ... Error:" line after them)
        errors = [ln for ln in log.splitlines() if re.match(r"[A-Za-z_.]*(Error|Exception): ", ln)]
        assert errors and "jetflow_sglang" not in log, log[-2000:]
        ends.append(re.sub(r"\d+(\.\d+)?", "#", errors[-1]))  # numbers: the memory free at that launch
    assert ends[0] == ends[1], ends


def test_guard_all_opts_other_servers_in(server_pool):
    """JETFLOW_GUARD_ALL=1: the request guard in a plain server (n above the limit is a 400 naming the field)."""
    from transformers import AutoTokenizer

    target = shared_tiny()
    srv = server_pool.get(target, PLAIN, env={"JETFLOW_GUARD_ALL": "1"}, name="guard-all", shared=False)
    ids = AutoTokenizer.from_pretrained(target)("The quick brown fox").input_ids
    with server_pool.use(srv):
        status, body = _send(srv, "/generate", _requests(ids)[4][1])
        assert status == 400 and "n = " in str(body), (status, body)
        assert _send(srv, *_requests(ids)[0])[0] == 200
