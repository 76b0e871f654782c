"""The SGLang GPU check: what the first GPU machine that can host SGLang 0.5.23 runs, in 10 minutes or less
(scripts/gpu_check_sglang.sh). Never run on a GPU yet: the machines lent so far carry torch 2.11, which SGLang 0.5.23
cannot use. `--device cpu` runs the same parts on a CPU (the tree backend, the captured round in place of CUDA graphs,
a tiny config in place of the 8B one), so that the script itself is known to work.

    bash scripts/gpu_check_sglang.sh                       # a GPU: every part, about 8 minutes
    python scripts/gpu_check_sglang.py --device cpu        # a CPU: every part at tiny sizes, about 5 minutes

1. identity: a tiny random Qwen3 and a tiny JetFlow head, float32. Per attention backend (flashinfer and triton on a
   GPU; jetflow_tree_native on a CPU) a plain server (SGLang's CUDA graphs on, its default), and JETFLOW servers with
   JETFLOW_GRAPHS off and on (its tree build and acceptance as CUDA graphs on a GPU, replayed traces on a CPU; SGLang's
   own graphs stay off for JETFLOW: docs/SERVING.md, GPU notes). One mixed batch (6 greedy and 2 sampled requests,
   sent together): every greedy output equals plain's token for token, every sampled one runs to its length.
2. syncs: the same JETFLOW servers count host synchronisations per round at the dispatch level (JETFLOW_COUNT_SYNCS=1,
   sglang/host_syncs.py): /server_info's steady-state count must be 0.
3. the round at 8B size: a Qwen3-8B config loaded with --load-format dummy (random weights, no download) and random
   heads of its width, bfloat16, concurrency 1, 128 tokens: JETFLOW at budgets 16 and 64 (graphs on), and SGLang's
   DFLASH at block 16 (its CUDA graphs) on a random DFlash-layout head. Random weights accept nothing, so this is the
   round's cost (output tok/s, JETFLOW's round split), not a speed-up (on a CPU, prompt lookup still accepts the
   dummy model's repetitive text). On a CPU: a 4-layer config of the 8B head layout, hidden 256.

Writes bench/results/gpu_check_sglang[_cpu].{json,md}; exits 1 if part 1 or 2 fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "sglang")]

from sgl_server import Server  # noqa: E402  (the launcher the tests and benchmarks use)

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
TINY_8B_SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "head_dim": 32}  # the CPU's stand-in: 8B's head layout, 4 layers
NEW, SAMPLED_T = 32, 0.8


class DeviceServer(Server):
    """sgl_server.Server on `device` (it launches with --device cpu)."""

    def __init__(self, device: str, *args, **kwargs):
        self.device = device
        super().__init__(*args, **kwargs)

    def _command(self) -> list[str]:
        cmd = super()._command()
        cmd[cmd.index("--device") + 1] = self.device
        return cmd


def serve(device: str, model, args: list[str], log: Path, env: dict) -> Server:
    cpu = {"JETFLOW_SGLANG_CPU": "1" if device == "cpu" else "0"}
    return DeviceServer(device, str(model), args, log, env={**cpu, **env}, spawn=True).wait_ready()  # as users


def mixed_batch(srv: Server, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 9, 17, 33, 12, 7, 20, 8)]
    bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": NEW, "temperature": 0 if i < 6 else SAMPLED_T,
                                                    "ignore_eos": True}} for i, p in enumerate(prompts)]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        return list(ex.map(lambda b: srv.generate(**b), bodies))


def identity(device: str, work: Path) -> list[dict]:
    """Parts 1 and 2: one row per (backend, graphs)."""
    from sgl_fixtures import build_tiny_head, build_tiny_qwen3

    target = build_tiny_qwen3(work / "tiny-qwen3")
    head = build_tiny_head(target, work / "tiny-head")
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    backends = ["flashinfer", "triton"] if device == "cuda" else ["jetflow_tree_native"]
    rows = []
    for backend in backends:
        common = ["--dtype", "float32", "--attention-backend", backend]
        plain = serve(device, target, common, work / f"plain-{backend}.log", {})
        try:
            want = mixed_batch(plain, vocab)
        finally:
            plain.stop()
        for graphs in ("off", "on"):
            args = [*common, "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path", str(head),
                    "--speculative-num-draft-tokens", "8"]
            row = {"backend": backend, "graphs": graphs}
            try:
                srv = serve(device, target, args, work / f"jetflow-{backend}-{graphs}.log",
                            {"JETFLOW_GRAPHS": graphs, "JETFLOW_COUNT_SYNCS": "1", "JETFLOW_OVERLAP": "on"})
            except (RuntimeError, TimeoutError) as e:
                rows.append({**row, "ok": False, "error": str(e)[-1500:]})
                continue
            try:
                got = mixed_batch(srv, vocab)
                state = srv.jetflow_state()
            finally:
                srv.stop()
            same = [a["output_ids"] == b["output_ids"] for a, b in zip(got[:6], want[:6])]
            lengths = [len(a["output_ids"]) == NEW for a in got[6:]]
            # steady state: the rounds of the largest batch (the server runs 4 at once), after the first of them (the
            # first round after a start reads the KV pool's pointers once)
            recent = [r for r in state["host_syncs"]["recent"] if not r["penalties"]]
            full = [r for r in recent if r["batch"] == max(x["batch"] for x in recent)][1:]
            syncs = max((r["syncs"] for r in full), default=None)
            rows.append({**row, "greedy_identical": f"{sum(same)}/{len(same)}", "sampled_ran": all(lengths),
                         "host_syncs_per_round": syncs, "steady_rounds": len(full), "graphs_state": state.get("graphs"),
                         "accept_length": round(sum(a["meta_info"]["completion_tokens"] for a in got)
                                                / max(1, sum(a["meta_info"]["spec_verify_ct"] for a in got)), 3),
                         "ok": all(same) and all(lengths) and syncs == 0})
    return rows


def dummy_models(device: str, work: Path) -> tuple[Path, Path, Path | None, str]:
    """(dummy target folder, random JetFlow head, random DFlash-layout head or None, why not)."""
    from transformers import AutoConfig

    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, save_head

    target = work / ("qwen3-8b-dummy" if device == "cuda" else "qwen3-8b-shape-dummy")
    target.mkdir(parents=True, exist_ok=True)
    cfg = {**QWEN3_8B, **({} if device == "cuda" else TINY_8B_SHAPE)}
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    tcfg = AutoConfig.from_pretrained(target)
    heads = {}
    for name, causal in (("head", True), ("bidir-head", False)):
        torch.manual_seed(0)
        taps = 4 if cfg["num_hidden_layers"] >= 8 else 2
        hcfg = JetFlowHeadConfig.for_target(tcfg, num_layers=1, n_taps=taps, causal=causal, block_size=16)
        if taps == 2:
            hcfg.tap_layers = [1, 2]
        if not causal:  # the DFlash release layout: mask slots embed a token row past the tokenizer's (Qwen3 pads)
            hcfg.qk_norm, hcfg.draft_vocab_size, hcfg.mask_token_id = True, 0, cfg["vocab_size"] - 1
        save_head(JetFlowHead(hcfg), work / name, dtype=torch.bfloat16)
        heads[name] = work / name
    try:
        from jetflow_sglang.head.export import export_head

        dflash = export_head(str(heads["bidir-head"]), str(work / "dflash-head"), "dflash", target_dir=str(target))
        return target, heads["head"], Path(dflash), ""
    except Exception as e:  # noqa: BLE001 - reported, and part 3 runs JETFLOW alone
        return target, heads["head"], None, f"no DFlash-layout head: {' '.join(str(e).split())[:300]}"


def round_cost(device: str, work: Path) -> dict:
    """Part 3: output tok/s at concurrency 1 and JETFLOW's round split, dummy weights."""
    target, head, dflash, why = dummy_models(device, work)
    common = ["--dtype", "bfloat16", "--load-format", "dummy", "--skip-tokenizer-init"]
    configs = {f"jetflow-b{b}": ([*common, "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path",
                                  str(head), "--speculative-num-draft-tokens", str(b)], {"JETFLOW_GRAPHS": "on"})
               for b in (16, 64)}
    configs["nospec"] = (common, {})
    if dflash is not None:
        cpu = ["--attention-backend", "jetflow_tree_native"] if device == "cpu" else []
        configs["dflash-b16"] = ([*common, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                                  str(dflash), "--speculative-num-draft-tokens", "16", *cpu],
                                 {"JETFLOW_BENCH_DFLASH_PEER": "1"} if device == "cpu" else {})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (64,), generator=g).tolist() for _ in range(3)]
    out = {"dflash": "ran" if dflash is not None else why, "configs": {}}
    for name, (args, env) in configs.items():
        try:
            srv = serve(device, target, args, work / f"{name}.log", env)
        except (RuntimeError, TimeoutError) as e:
            out["configs"][name] = {"error": str(e)[-1500:]}
            continue
        try:
            srv.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 16, "temperature": 0})  # warm-up
            t0, tokens = time.perf_counter(), 0
            for p in prompts:
                tokens += len(srv.generate(input_ids=p, sampling_params={"max_new_tokens": 128, "temperature": 0,
                                                                          "ignore_eos": True})["output_ids"])
            row = {"output_tok_s": round(tokens / (time.perf_counter() - t0), 2)}
            if name.startswith("jetflow"):
                state = srv.jetflow_state()
                row |= {k: state.get(k) for k in ("round_split", "host_syncs_per_round", "graphs")}
            out["configs"][name] = row
        finally:
            srv.stop()
    return out


def report(meta: dict, rows: list[dict], cost: dict | None) -> str:
    lines = [f"# SGLang check on {meta['device_name']}", "", f"`{meta['command']}`, {meta['date']}", "",
             "Host syncs: the most in one steady-state round (the largest batch, after its first round).", "",
             "| backend | graphs | greedy identical | sampled ran | host syncs / round | accept length | ok |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['graphs']} | did not start | | | | no |")
        else:
            lines.append(f"| {r['backend']} | {r['graphs']} | {r['greedy_identical']} | {r['sampled_ran']} | "
                         f"{r['host_syncs_per_round']} | {r['accept_length']} | {'yes' if r['ok'] else 'NO'} |")
    if cost is not None:
        lines += ["", f"Round cost, dummy weights, concurrency 1 (DFLASH: {cost['dflash']}):", "",
                  "| config | output tok/s | round split (ms) |", "|---|---|---|"]
        for name, c in cost["configs"].items():
            split = ", ".join(f"{k} {v * 1000:.1f}" for k, v in (c.get("round_split") or {}).items())
            lines.append(f"| {name} | {c.get('output_tok_s', 'did not start')} | {split} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-round-cost", action="store_true", help="parts 1 and 2 only")
    ap.add_argument("--out", default=None, help="output stem (default bench/results/gpu_check_sglang[_cpu])")
    a = ap.parse_args(argv)
    from jetflow_sglang.machine import cpu_model

    name = torch.cuda.get_device_name() if a.device == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores"
    meta = {"device": a.device, "device_name": name, "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = identity(a.device, work)
        for r in rows:
            print(json.dumps(r)[:400], flush=True)
        cost = None if a.skip_round_cost else round_cost(a.device, work)
    stem = Path(a.out or ROOT / "bench" / "results" / ("gpu_check_sglang" + ("_cpu" if a.device == "cpu" else "")))
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "identity": rows, "round_cost": cost}, indent=1))
    text = report(meta, rows, cost)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
