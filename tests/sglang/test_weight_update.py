"""What RL trainers do to an SGLang server between rollouts, on JETFLOW: pause generation mid-decode and continue it
(`/pause_generation` in place or by retracting the running requests, `/continue_generation`), and update the weights
(`/update_weights_from_disk`).

Weight updates: after a JETFLOW server loads
new target weights in place, its output must be that of a plain server started on those weights. Anything that kept
a copy of the old target weights on the verify path (a transposed GEMM weight, a fused LM head) would fail here.
The head keeps drafting (it was trained for the old weights, and keeps the LM-head rows of its draft vocabulary that
it gathered at launch), which may cost acceptance, never correctness. The default target with the shipped head,
float32, JETFLOW synchronous and on the overlap scheduler; the new weights are every matrix of the target, embedding
(the tied LM head) included, scaled by 1 + 0.05 N(0, 1)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import time

import pytest
import requests
import torch

from tests.sglang.sgl_server import NO_TRITON, Server, chat_ids, jetflow_server, running

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.", "What is 12 times 7?",
           "Write a sentence about the sea."]


def perturbed_copy(target: str, out) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, out)
    weights = load_file(f"{target}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = (w.float() * (1 + 0.05 * torch.randn(w.shape, generator=g))).to(w.dtype)
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from jetflow_sglang.paths import default_paths

    root = tmp_path_factory.mktemp("weights")
    target, head = default_paths()
    new = perturbed_copy(str(target), root / "new-weights")
    ups = (jetflow_server(target, head, root / "sync.log", 8, env={"JETFLOW_OVERLAP": "off", **NO_TRITON}),
           jetflow_server(target, head, root / "overlap.log", 8, env={"JETFLOW_OVERLAP": "on", **NO_TRITON}),
           Server(new, ["--dtype", "float32", "--disable-overlap-schedule"], root / "plain.log", env=NO_TRITON))
    for up in running(*ups):
        yield (*up, str(target), new)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_updated_weights_serve_as_plain_on_them(servers, mode):
    sync, overlap, plain, target, new = servers
    spec = sync if mode == "sync" else overlap
    greedy = [dict(input_ids=ids, return_logprob=True, sampling_params={"temperature": 0, "max_new_tokens": 32})
              for ids in chat_ids(target, PROMPTS)]
    sampled = dict(input_ids=greedy[0]["input_ids"],
                   sampling_params={"temperature": 0.8, "max_new_tokens": 32, "ignore_eos": True})
    before = [spec.generate(**b)["output_ids"] for b in greedy]  # also fills the radix cache with old-weight KV

    bad = spec.post("/update_weights_from_disk", {"model_path": str(new) + "-missing"})
    assert not bad.json().get("success")
    assert [spec.generate(**b)["output_ids"] for b in greedy] == before  # a failed update changes nothing

    r = spec.post("/update_weights_from_disk", {"model_path": new})
    assert r.status_code == 200 and r.json()["success"], r.text
    with cf.ThreadPoolExecutor(5) as ex:
        got = list(ex.map(lambda b: spec.generate(**b), greedy + [sampled]))
    assert [a["output_ids"] for a in got[:len(greedy)]] != before  # the new weights are served
    for body, a in zip(greedy, got):
        b = plain.generate(**body)
        assert a["output_ids"] == b["output_ids"]
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3
    assert len(got[-1]["output_ids"]) == 32
    tokens = sum(len(a["output_ids"]) for a in got[:len(greedy)])
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got[:len(greedy)]) < tokens  # the head still drafts
    assert requests.get(spec.url + "/health", timeout=30).ok


@pytest.mark.parametrize("mode", ["overlap"])  # a round in flight when the pause lands (sync ran too until 2026-12-07)
def test_pause_and_continue_mid_decode(servers, mode):
    """Requests paused mid-decode (in place, and retracted with the cache flushed while paused) and then continued
    finish as on plain SGLang; an abort while paused ends them."""
    sync, overlap, plain, target, new = servers
    spec = sync if mode == "sync" else overlap
    assert spec.post("/update_weights_from_disk", {"model_path": new}).json()["success"]  # plain's weights
    greedy = [dict(input_ids=ids, return_logprob=True,
                   sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True})
              for ids in chat_ids(target, PROMPTS[:3])]
    sampled = dict(input_ids=greedy[0]["input_ids"],
                   sampling_params={"temperature": 0.8, "max_new_tokens": 64, "ignore_eos": True})
    refs = [plain.generate(**b) for b in greedy]
    for pause in ("in_place", "retract", "abort"):
        start = spec.jetflow_state()["steps"]
        with cf.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(spec.generate, **b) for b in greedy + [sampled]]
            deadline = time.monotonic() + 60
            while spec.jetflow_state()["steps"] < start + 4 and time.monotonic() < deadline:  # decoding has begun
                time.sleep(0.1)
            assert spec.post("/pause_generation", {"mode": pause}).status_code == 200
            if pause == "retract":  # the KV is free while paused; continuing recomputes it
                assert spec.flush_cache()
            assert spec.post("/continue_generation", {}).status_code == 200
            got = [f.result() for f in futs]
        if pause == "abort":
            assert all(g["meta_info"]["finish_reason"]["type"] == "abort" for g in got)
            assert all(len(g["output_ids"]) < 64 for g in got)
            continue
        for a, b in zip(got, refs):
            assert a["output_ids"] == b["output_ids"], pause
            la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
            assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3
        assert len(got[-1]["output_ids"]) == 64
    assert spec.generate(**greedy[0])["output_ids"] == refs[0]["output_ids"]
