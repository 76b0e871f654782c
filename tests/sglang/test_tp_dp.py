"""Tensor and data parallelism on CPU with real servers on 127.0.0.1.

--tp 2 (gloo; one core per rank through SGLANG_CPU_OMP_THREADS_BIND, since SGLang's CPU engine asserts one NUMA node
per rank otherwise): JETFLOW must be token-identical to plain decoding (HF greedy, which --tp 2 without speculation
matches on the tiny model). The head's embedding is the
target's vocab-parallel embedding forward and the LM head is gathered (sglang/target_view.py); rank 0 decides the
budget, trees and accepted paths (sglang/tp_sync.py). JETFLOW_BUDGET=auto makes the ranks' own (timing-based) budget
choices differ, so the test fails if the decisions are not broadcast.
--dp 2: two schedulers behind SGLang's DP controller, 8 concurrent requests, identical to no speculation (HF greedy,
which the plain server matches: test_sglang_server.py).
The TP server runs twice: synchronous, and on SGLang's overlap scheduler (JETFLOW_OVERLAP=on); DP on the overlap one.
Servers run one after another (each TP/DP server is 2 scheduler processes of ~3 GB).
"""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import torch

from tests.sglang.sgl_fixtures import build_tiny_head, build_tiny_qwen3, hf_greedy  # noqa: E402
from tests.sglang.sgl_server import Server  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "def fib(n):", "1 2 3 4 5", "Once upon a time there was",
           "Speculative decoding drafts", "SGLang schedules requests", "abc abc abc", "The tiny model"]
CPU_BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (2 ranks on a 1-NUMA-node machine)
NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpdp")
    target = build_tiny_qwen3(root / "tiny-qwen3")
    return str(target), str(build_tiny_head(target, root / "tiny-head")), root


@pytest.fixture(scope="module")
def prompt_ids(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[0])
    return [tok(p).input_ids for p in PROMPTS]


def _serve(model, args, log, env=None):
    return Server(model, ["--dtype", "float32", *args], log, env={**CPU_BIND, **(env or {})}, spawn=True).wait_ready()


def _run(server, prompt_ids, concurrent: int):
    body = lambda ids: dict(input_ids=ids, sampling_params={"max_new_tokens": NEW, "temperature": 0,  # noqa: E731
                                                            "ignore_eos": True})
    with cf.ThreadPoolExecutor(concurrent) as pool:
        return list(pool.map(lambda ids: server.generate(timeout=600, **body(ids)), prompt_ids))


def _jetflow(head, n="6"):
    return ["--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path", head,
            "--speculative-num-draft-tokens", n]


def test_tp2_jetflow_identical_to_plain_decoding(models, prompt_ids):
    """The reference is HF greedy, which a plain --tp 2 server matched on these prompts (a third two-rank server here
    until 2026-12-07): the tiny model's logit gaps are far wider than the ranks' reduction-order noise."""
    target, head, root = models
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    plain = [hf_greedy(ref, ids, NEW, stop_at_eos=False) for ids in prompt_ids[:4]]
    for overlap in ("off", "on"):  # the worker synchronous, then on SGLang's overlap scheduler
        log = root / f"tp2_jetflow_overlap_{overlap}.log"
        srv = _serve(target, ["--tp", "2", *_jetflow(head)], log, env={"JETFLOW_BUDGET": "auto",
                                                                       "JETFLOW_OVERLAP": overlap})
        try:
            outs = _run(srv, prompt_ids[:4], 2)
        finally:
            srv.stop()
        for ids, p, o in zip(prompt_ids, plain, outs):
            assert o["output_ids"] == p, (overlap, ids, o["output_ids"], p)
            assert o["meta_info"]["spec_verify_ct"] > 0
        assert "TP1" in log.read_text(errors="replace")  # really two ranks


def test_dp2_jetflow_serves_8_concurrent_identical(models, prompt_ids):
    target, head, root = models
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    want = [hf_greedy(ref, ids, NEW, stop_at_eos=False) for ids in prompt_ids]
    for overlap in ("on",):  # on SGLang's overlap scheduler (each DP rank is a one-rank worker: the synchronous
        log = root / f"dp2_jetflow_overlap_{overlap}.log"  # one is test_tp2's and every one-rank module's)
        srv = _serve(target, ["--dp", "2", *_jetflow(head)], log, env={"JETFLOW_OVERLAP": overlap})
        try:
            outs = _run(srv, prompt_ids, 8)
        finally:
            srv.stop()
        for ids, w, o in zip(prompt_ids, want, outs):
            assert o["output_ids"] == w, (overlap, ids)
            assert o["meta_info"]["spec_verify_ct"] > 0
        assert "DP1" in log.read_text(errors="replace")
