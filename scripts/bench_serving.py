"""Serving benchmark: SGLang with JETFLOW at several budgets versus no speculation, same build, same run.

For each server configuration (baseline, then JETFLOW at each --budgets value) it starts
`python -m sglang.launch_server` on 127.0.0.1, sends the same chat prompts (bench/data/*.jsonl) at each
concurrency level, and records output throughput, per-request latency and the server's accept length.
Results: bench/results/sglang_serving.json and .md.

    python scripts/bench_serving.py                                 # default SmolLM2 + shipped head, CPU
    python scripts/bench_serving.py --drafter ngram --budgets 4 8   # prompt lookup instead of the head
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))
from sgl_server import Server  # noqa: E402  (the same launcher the e2e tests use)


def load_prompts(n: int) -> list[str]:
    out = []
    files = sorted((ROOT / "bench" / "data").glob("*.jsonl"))
    rows = [[json.loads(l)["prompt"] for l in f.read_text().splitlines() if l.strip()] for f in files]
    for i in range(max(len(r) for r in rows)):  # interleave datasets: chat, code, math
        out += [r[i] for r in rows if i < len(r)]
    return out[:n]


def run_level(srv: Server, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    def one(ids):
        t0 = time.perf_counter()
        r = srv.generate(input_ids=ids, sampling_params={"max_new_tokens": max_tokens, "temperature": 0},
                         timeout=1800)
        m = r["meta_info"]
        return time.perf_counter() - t0, m["completion_tokens"], m.get("spec_verify_ct")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in res)
    toks = sum(x[1] for x in res)
    rounds = sum(x[2] or 0 for x in res)
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": toks, "wall_s": round(wall, 3),
            "output_tok_per_s": round(toks / wall, 3), "latency_mean_s": round(statistics.mean(lat), 3),
            "latency_p50_s": round(lat[len(lat) // 2], 3), "latency_max_s": round(lat[-1], 3),
            # tokens per target forward of a decode round (the first token comes from prefill)
            "accept_length": round((toks - len(prompts)) / rounds, 3) if rounds else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target folder (default: the converted SmolLM2-135M-Instruct)")
    ap.add_argument("--head", help="JetFlow head folder (default: the shipped head)")
    ap.add_argument("--drafter", default=None, help="JETFLOW_DRAFTER (default: jetflow with a head, else ngram)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang_serving"))
    a = ap.parse_args(argv)
    if any(c < 1 for c in a.concurrency) or any(not 1 <= b <= 64 for b in a.budgets) or a.requests < 1:
        ap.error("concurrency and requests must be >= 1, budgets in [1, 64]")

    from jetflow_sglang.paths import default_paths

    target, shipped = default_paths()
    model = a.model or target
    head = a.head or (shipped if (Path(shipped) / "config.json").is_file() else None)
    drafter = a.drafter or ("jetflow" if head else "ngram")
    if drafter not in ("ngram", "ar") and not head:
        ap.error(f"drafter {drafter!r} needs --head (no shipped head found at {shipped})")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [_ids(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True)) for p in load_prompts(a.requests)]
    configs = [("baseline", [], {})] + [
        (f"jetflow-b{b}", ["--speculative-algorithm", "JETFLOW", "--speculative-num-draft-tokens", str(b)]
         + (["--speculative-draft-model-path", head] if head and drafter not in ("ngram", "ar") else []),
         {"JETFLOW_DRAFTER": drafter}) for b in a.budgets]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="jetflow-bench-"))  # server logs stay out of the results folder
    results = []
    bar = tqdm(total=len(configs) * len(a.concurrency), desc="bench", unit="level")
    for name, args, env in configs:
        srv = Server(model, ["--dtype", a.dtype, *args], logs / f"{name}.log", env=env)
        try:
            srv.wait_ready()
            srv.post("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4})  # warm-up
            for c in a.concurrency:
                bar.set_postfix_str(f"{name} c={c}")
                row = {"config": name, **run_level(srv, prompts, c, a.max_tokens)}
                results.append(row)
                bar.update(1)
        finally:
            srv.stop()
    bar.close()
    meta = {"model": model, "head": head, "drafter": drafter, "dtype": a.dtype, "max_tokens": a.max_tokens,
            "requests_per_level": len(prompts), "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
            "sglang": _version("sglang"), "torch": _version("torch"), "date": time.strftime("%Y-%m-%d %H:%M")}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    base = {r["concurrency"]: r["output_tok_per_s"] for r in results if r["config"] == "baseline"}
    lines = [f"# SGLang serving: JETFLOW vs no speculation ({meta['date']})", "",
             f"model `{model}`, head `{head}`, drafter `{drafter}`, dtype {a.dtype}, {len(prompts)} chat requests "
             f"per level, max_tokens {a.max_tokens}, greedy; {meta['machine']}; sglang {meta['sglang']}.", "",
             "| config | concurrency | output tok/s | speedup | latency mean (s) | p50 | max | accept len |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        sp = r["output_tok_per_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else float("nan")
        acc = r["accept_length"]
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['output_tok_per_s']:.1f} | {sp:.2f}x | "
                     f"{r['latency_mean_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_max_s']:.2f} | "
                     f"{'-' if acc is None else f'{acc:.2f}'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


if __name__ == "__main__":
    sys.exit(main())
