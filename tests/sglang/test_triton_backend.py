"""`--attention-backend jetflow_tree_triton` end to end on the CPU, under Triton's interpreter: real SGLang servers on
a tiny random Qwen3 with a head made for it, float32 greedy, verified by the project's Triton kernel over SGLang's
own KV pool. Token-identical to the plain server at budgets 1 (page size 1, synchronous) and 16 (page size 16, on
the overlap scheduler), for a batch of 3 requests of different lengths and for a radix-cache hit, the head drafting through
the same kernel over its pool (paged, as on a GPU); a sampled request beside a
greedy one in one batch; and the launch refuses the backend on a CPU without TRITON_INTERPRET=1, in one line. The
full-tree server runs with JETFLOW_GRAPHS=on: its head forward (over the paged pool), tree build and acceptance
replay from their captures (core/graphs.py, the CPU back end), as a GPU server's would under CUDA graphs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests
import torch

from tests.sglang.sgl_fixtures import _build_tiny, build_tiny_head, shared_head, shared_tiny
from tests.sglang.sgl_server import plain_tiny

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)
import sglang  # noqa: E402,F401

pytestmark = pytest.mark.slow
NEW = 20
# (budget, page size, overlap) per JETFLOW server: a one-node tree synchronous on page size 1, full trees spanning
# 16-token pages on SGLang's overlap scheduler (JETFLOW_OVERLAP=on) with the round's pieces captured (JETFLOW_GRAPHS). Each server runs interpreted Triton (~1 min to
# start and serve here): the kernel is the same for every family (a Llama and two more trees ran here before
# 2026-12-07; the kernel's own matrix, tests/test_kernels_triton.py, covers families' shapes, GQA and ragged pages).
SERVERS = {"Qwen3": [(1, 1, False), (16, 16, True)]}
PROMPTS = ["The quick brown fox jumps over", "def fib(n):\n    return", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"]
BACKEND = ["--attention-backend", "jetflow_tree_triton"]


def _jetflow(pool, target, head, budget: int, page: int, overlap: bool):
    return pool.get(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                             "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens",
                             str(budget), "--page-size", str(page), *BACKEND],
                    env={"TRITON_INTERPRET": "1", "JETFLOW_OVERLAP": "on" if overlap else "off",
                         "JETFLOW_GRAPHS": "on" if budget > 1 else "off"},
                    name=f"triton-b{budget}-p{page}", shared=False)


@pytest.fixture(scope="module", params=list(SERVERS))
def family(request, server_pool):
    target = shared_tiny(request.param)
    head = shared_head(target)
    plain = plain_tiny(server_pool, target, shared=request.param == "Qwen3")  # the tiny Qwen3's: the session's
    spec = [_jetflow(server_pool, target, head, b, p, o) for b, p, o in SERVERS[request.param]]
    with server_pool.use(plain, *spec) as servers:
        yield request.param, target, servers[0], servers[1:]


def _ids(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p).input_ids for p in PROMPTS]


def _batch(srv, ids: list[list[int]]) -> list[dict]:
    """The 3 prompts in one /generate call: SGLang schedules them as one batch of different lengths."""
    return srv.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})


def test_triton_backend_is_token_identical_to_the_plain_server(family):
    name, target, plain, spec = family
    ids = _ids(target)
    want = [o["output_ids"] for o in _batch(plain, ids)]
    for srv, (budget, page, _) in zip(spec, SERVERS[name]):
        got = _batch(srv, ids)
        assert [o["output_ids"] for o in got] == want, (name, budget, page)
        if budget > 1:  # SGLang reports spec statistics only when drafts were proposed (budget > 1)
            assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in got), (name, budget)
        log = open(srv.log, errors="replace").read()
        assert "jetflow_tree_triton: TARGET_VERIFY through the Triton tree kernel" in log, \
            "the server did not verify with the Triton backend"
        assert "head context=paged" in log  # the head reads its pool in place (head_pool.PagedContext), as on a GPU
        if budget > 1:  # the head forward replays from its capture (one per batch bucket and budget), never refused
            graphs = srv.jetflow_state()["graphs"]
            assert graphs["refused"] == 0 and graphs["replays"] > graphs["captures"], graphs
            assert any(k.startswith("head (16,") for k in graphs["keys"]), graphs


def test_triton_backend_radix_hit_is_token_identical(family):
    name, target, plain, spec = family
    ids = _ids(target)
    longer = ids[2] + ids[0]  # shares the third prompt as a prefix: served from the radix cache
    want = plain.generate(input_ids=longer, sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                                              "ignore_eos": True})["output_ids"]
    for srv, (budget, page, _) in zip(spec, SERVERS[name]):
        srv.generate(input_ids=ids[2], sampling_params={"max_new_tokens": 2, "temperature": 0})  # warm the prefix
        out = srv.generate(input_ids=longer, sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                                               "ignore_eos": True})
        assert out["meta_info"]["cached_tokens"] > 0, (name, budget, page, out["meta_info"])
        assert out["output_ids"] == want, (name, budget, page)


def test_triton_backend_serves_a_mixed_greedy_and_sampled_batch(family):
    """One greedy and one sampled request (the OpenAI routes' default temperature 1.0) in one batch, on one-node,
    small and full trees: the greedy one stays token-identical to the plain server, the sampled one gets all its
    tokens from the vocabulary, and the server keeps serving."""
    name, target, plain, spec = family
    ids = _ids(target)[:2]
    greedy = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    sampled = {"max_new_tokens": NEW, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    want = plain.generate(input_ids=ids[0], sampling_params=greedy)["output_ids"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    for srv, (budget, page, _) in zip(spec, SERVERS[name]):
        got = srv.generate(input_ids=ids, sampling_params=[greedy, sampled])
        assert got[0]["output_ids"] == want, (name, budget, page)
        assert len(got[1]["output_ids"]) == NEW and all(0 <= t < vocab for t in got[1]["output_ids"]), \
            (name, budget, page, got[1]["output_ids"])
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200, (name, budget, page)


def test_triton_backend_on_cpu_needs_the_interpreter(tmp_path):
    """Without TRITON_INTERPRET=1 the launch stops at argument resolution (before any model loads), in one line."""
    target = _build_tiny(tmp_path / "target", "Qwen3", 0)
    head = build_tiny_head(target, tmp_path / "head")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(JETFLOW_SGLANG_CPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), "--device", "cpu",
                          "--dtype", "float32", "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path",
                          str(head), *BACKEND, "--port", "1"], capture_output=True, text=True, env=env, timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode == 2, (res.returncode, log[-3000:])
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--attention-backend jetflow_tree_triton" in errors[0] \
        and "TRITON_INTERPRET=1" in errors[0], log[-3000:]
    assert "Load weight" not in log  # refused before the target loads
