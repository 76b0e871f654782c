"""SGLang's own DFLASH as a benchmark peer on the CPU (jetflow_sglang/sglang/cpu/dflash_peer.py, switched on by
JETFLOW_BENCH_DFLASH_PEER=1 in the server's launch environment), on a tiny random Qwen3 target with a tiny
bidirectional head in the DFlash release layout, float32, greedy:

- DFLASH's output is token-identical to a plain server's;
- JETFLOW with JETFLOW_DRAFTER=dflash (lookup off, fixed budget = DFLASH's block size) on the same head folder
  accepts exactly what DFLASH accepts: the same number of verify steps per request (spec_verify_ct in meta_info, so
  the same tokens per verify) and the same output;
- that chain serves greedy, sampled and OpenAI-default requests batched together (greedy stays the plain output);
- a causal release head ("jetspec" export, is_causal true) drafts causally: DFLASH needs as many verify steps as
  JETFLOW's width-1 tree of the same head;
- without the switch, DFLASH still refuses the CPU (the patches are the benchmark's alone).
At most two servers run at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.sglang.sgl_fixtures import build_tiny_qwen3, shared_tiny
from tests.sglang.sgl_server import Server, plain_tiny

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
BLOCK = 8  # the servers' block / budget
HEAD_BLOCK = 16  # the block the head was built with: a longer one, as with the shipped heads (16) served at 8
NEW_TOKENS = 40
PROMPTS = ["The quick brown fox jumps over", "def fib(n):\n    return", "1 2 3 4 5 6 7 8",
           "Once upon a time there was a tiny model", "SGLang schedules requests with continuous"]
PEER = {"JETFLOW_BENCH_DFLASH_PEER": "1"}


def _release_state(head) -> dict:
    """A JetFlowHead's weights under the DFlash release names (no mask embedding, no vocabulary map)."""
    out = {}
    for name, tensor in head.state_dict().items():
        if name in ("mask_embedding", "vocab_ids"):
            continue
        parts = name.split(".")
        if parts[0] == "layers":
            if parts[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                parts.insert(2, "self_attn")
            elif parts[2] in ("gate_proj", "up_proj", "down_proj"):
                parts.insert(2, "mlp")
        out[".".join(parts)] = tensor.detach().to(torch.float32).contiguous()
    return out


def _write_release(head, tc, out: Path) -> None:
    """The release layout written here, for a checkout without jetflow_sglang.head.export (bidirectional only)."""
    from safetensors.torch import save_file

    cfg = head.config
    save_file(_release_state(head), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "float32",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": tc.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": tc.max_position_embeddings, "tie_word_embeddings": False,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "block_size": cfg.block_size, "num_target_layers": tc.num_hidden_layers,
        "dflash_config": {"target_layer_ids": cfg.tap_layers, "mask_token_id": cfg.mask_token_id},
    }, indent=2))


def build_release_head(target_dir, out, block_size: int = HEAD_BLOCK, seed: int = 1, causal: bool = False) -> Path:
    """A 1-layer head in the DFlash release layout (what SGLang's DFLASH loads and JETFLOW reads as a release head):
    bidirectional ("dflash") or causal ("jetspec", is_causal true), tapping layers 1 and 2 of the tiny target,
    initialised from the target (its last layer and final norm; fc passes the deepest tap through) plus a little
    noise; mask slots embed the target's pad token. Built in this project's format, then exported with
    jetflow_sglang.head.export (written directly where this checkout has no exporter)."""
    from transformers import AutoModelForCausalLM

    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, init_from_target, save_head

    out = Path(out)
    if (out / "config.json").exists():
        return out
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tc = target.config
    cfg = JetFlowHeadConfig.for_target(tc, num_layers=1, n_taps=2, causal=causal, block_size=block_size)
    cfg.tap_layers, cfg.mask_token_id = [1, 2], int(tc.pad_token_id)
    assert cfg.qk_norm  # SGLang's DFLASH always applies q/k norms
    torch.manual_seed(seed)
    head = init_from_target(JetFlowHead(cfg), target)
    with torch.no_grad():
        for p in head.layers.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    try:
        from jetflow_sglang.head.export import export_head
    except ImportError:
        assert not causal, "a causal release head needs jetflow_sglang.head.export"
        out.mkdir(parents=True, exist_ok=True)
        _write_release(head, tc, out)
        return out
    src = save_head(head, out.with_name(out.name + "-src"), dtype=torch.float32)
    export_head(src, out, "jetspec" if causal else "dflash", target_dir=target_dir)
    return out


def dflash_args(head, block: int) -> list[str]:
    return ["--dtype", "float32", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(head),
            "--speculative-num-draft-tokens", str(block), "--attention-backend", "jetflow_tree_native"]


def jetflow_dflash_args(head, block: int) -> tuple[list[str], dict]:
    return (["--dtype", "float32", "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path", str(head),
             "--speculative-num-draft-tokens", str(block)], {"JETFLOW_DRAFTER": "dflash", "JETFLOW_LOOKUP": "off"})


def _run(srv: Server, prompts: list[list[int]]) -> list[dict]:
    outs = []
    for ids in prompts:
        o = srv.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                        "ignore_eos": True})
        outs.append({"ids": o["output_ids"], "meta": o["meta_info"]})
    return outs


def _mixed(srv: Server, prompts: list[list[int]]) -> list[tuple]:
    """Greedy and sampled /generate calls and an OpenAI chat call with its default temperature (1.0), all at once,
    so that the chain's rounds batch greedy and sampled requests together: (kind, prompt index, status, body)."""
    import concurrent.futures as cf

    import requests

    model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def call(job):
        kind, i = job
        if kind == "chat":
            r = requests.post(srv.url + "/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 16})
        else:
            params = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0} if kind == "greedy" else \
                {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20}
            r = srv.post("/generate", {"input_ids": prompts[i], "sampling_params": params})
        return kind, i, r.status_code, r.json()

    jobs = [(kind, i) for i in range(len(prompts)) for kind in ("greedy", "sampled")] + [("chat", 0), ("chat", 1)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(call, jobs))


def _state(srv: Server) -> dict:
    import requests

    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, server_pool):
    """Every server's outputs on the same prompts; at most two servers up at a time."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("dflash_peer")
    target = shared_tiny()
    head = build_release_head(target, root / "head")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(p).input_ids for p in PROMPTS]
    out = {"target": target, "head": head}
    dflash = Server(str(target), dflash_args(head, BLOCK), root / "dflash.log", env=PEER)
    try:
        dflash.wait_ready()
        with server_pool.use(plain_tiny(server_pool, target)) as (plain,):
            out["dflash"], out["plain"] = _run(dflash, prompts), _run(plain, prompts)
        out["dflash_state"] = _state(dflash)
        out["dflash_log"] = dflash.log
    except BaseException:
        dflash.stop()
        raise
    args, env = jetflow_dflash_args(head, BLOCK)
    jet = Server(str(target), args, root / "jetflow.log", env=env)
    try:
        jet.wait_ready()
        out["jetflow"] = _run(jet, prompts)
        out["jetflow_state"] = _state(jet)
        out["jetflow_mixed"] = _mixed(jet, prompts)
    finally:
        jet.stop()
        dflash.stop()
    return out


def test_dflash_on_cpu_is_token_identical_to_plain(runs):
    for p, d, a in zip(PROMPTS, runs["dflash"], runs["plain"]):
        assert len(d["ids"]) == NEW_TOKENS, p
        assert d["ids"] == a["ids"], p
        assert d["meta"]["spec_verify_ct"] > 0, (p, d["meta"])  # it really went through DFLASH verify steps
    log = Path(runs["dflash_log"]).read_text(errors="replace")
    assert "dflash_peer_native" in log  # the draft ran on the peer backend (bidirectional), not jetflow_tree_native
    # the head drafts something: some step accepted a drafted token (else the fairness check below is vacuous)
    assert sum(d["meta"]["spec_verify_ct"] for d in runs["dflash"]) < len(PROMPTS) * (NEW_TOKENS - 1)


def test_jetflow_dflash_drafter_accepts_exactly_what_dflash_accepts(runs):
    """Same head, same block: JETFLOW's chain drafter and SGLang's DFLASH draft the same tokens, so every request
    needs the same number of verify steps (tokens per verify = completion tokens / spec_verify_ct). The head was
    built with a 16-token block and both serve it at 8, so both must draft with a block of the chain's length."""
    for p, d, j in zip(PROMPTS, runs["dflash"], runs["jetflow"]):
        assert j["ids"] == d["ids"], p
        assert j["meta"]["spec_verify_ct"] == d["meta"]["spec_verify_ct"], (p, d["meta"], j["meta"])
        assert j["meta"]["spec_accept_length"] == pytest.approx(d["meta"]["spec_accept_length"]), p
    for key in ("dflash_state", "jetflow_state"):
        assert runs[key].get("avg_spec_accept_length") is None or runs[key]["avg_spec_accept_length"] >= 1.0, runs[key]


def test_the_chain_serves_mixed_greedy_and_sampled_batches(runs):
    """The chain drafter (no lookup, no KV move, argmax without log-softmax) with sampled requests in its rounds:
    every call succeeds, sampled requests get their full length, and the greedy ones stay the plain server's."""
    for kind, i, status, body in runs["jetflow_mixed"]:
        assert status == 200, (kind, i, body)
        if kind == "greedy":
            assert body["output_ids"] == runs["plain"][i]["ids"], (kind, i)
        elif kind == "sampled":
            assert len(body["output_ids"]) == NEW_TOKENS and body["meta_info"]["spec_verify_ct"] > 0, (kind, i)
        else:
            assert body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"] >= 1


def test_a_causal_release_head_drafts_causally(runs, tmp_path):
    """A causal head exported as "jetspec" (is_causal true) makes DFLASH's draft layers DECODER layers; the peer
    backend then masks the block causally. Its chain is the per-depth argmax of the head's one forward, which is what
    JETFLOW's tree of width 1 and budget = block builds from the same head, so both need the same verify steps, and
    the output is the plain server's."""
    head = build_release_head(runs["target"], tmp_path / "causal-head", causal=True)
    assert json.loads((head / "config.json").read_text())["is_causal"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runs["target"])
    prompts = [tok(p).input_ids for p in PROMPTS]
    dflash = Server(str(runs["target"]), dflash_args(head, BLOCK), tmp_path / "dflash-causal.log", env=PEER)
    jet = Server(str(runs["target"]), ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                       "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens",
                                       str(BLOCK), "--speculative-eagle-topk", "1"],
                 tmp_path / "jetflow-causal.log", env={"JETFLOW_DRAFTER": "jetflow", "JETFLOW_LOOKUP": "off"})
    try:
        got_d, got_j = _run(dflash.wait_ready(), prompts), _run(jet.wait_ready(), prompts)
    finally:
        dflash.stop()
        jet.stop()
    for p, d, j, a in zip(PROMPTS, got_d, got_j, runs["plain"]):
        assert d["ids"] == a["ids"] and j["ids"] == a["ids"], p
        assert j["meta"]["spec_verify_ct"] == d["meta"]["spec_verify_ct"], (p, d["meta"], j["meta"])
    assert sum(d["meta"]["spec_verify_ct"] for d in got_d) < len(PROMPTS) * (NEW_TOKENS - 1)


def test_dflash_still_refuses_the_cpu_without_the_benchmark_switch(tmp_path):
    """The patches are the benchmark's alone: a server without JETFLOW_BENCH_DFLASH_PEER stops at SGLang's gate."""
    target = build_tiny_qwen3(tmp_path / "target")
    head = build_release_head(target, tmp_path / "head")
    srv = Server(str(target), dflash_args(head, BLOCK), tmp_path / "gate.log")
    with pytest.raises(RuntimeError, match="exited"):
        srv.wait_ready()
    assert "DFLASH speculative decoding is not supported" in Path(srv.log).read_text(errors="replace")


def test_a_bad_switch_value_is_one_line():
    env = {**os.environ, "JETFLOW_SGLANG_CPU": "1", "JETFLOW_BENCH_DFLASH_PEER": "maybe"}
    p = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "ran" not in p.stdout
    assert p.stderr.strip() == "error: JETFLOW_BENCH_DFLASH_PEER must be 1 or 0; got 'maybe'"
