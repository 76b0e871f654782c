"""Verify-forward cost by tree size, stock nn.Linear against rowgemm (W @ X^T), interleaved, on the default target.

    python scripts/bench_rowgemm.py                 # sizes 1..64, 9 repetitions, 2 threads
Writes bench/results/rowgemm.{json,md}: the median ms of one target forward over an n-node chain tree on a ~60-token
prompt, and its ratio to a one-token step of the same mode (the cost a speculative round must beat).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jetflow_sglang.core import rowgemm  # noqa: E402
from jetflow_sglang.machine import cpu_model  # noqa: E402
from jetflow_sglang.engine.stack import load_stack  # noqa: E402
from jetflow_sglang.core.tree import DraftTree  # noqa: E402

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def chain(n: int) -> DraftTree:
    tree, node = DraftTree.root(5), 0
    for i in range(n - 1):
        node = tree.add(7 + i, node, -0.1 * i)
    return tree


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rowgemm"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_stack(drafter="ar", dtype=a.dtype)
    target.prefill(target.encode_chat(PROMPT))
    sizes = [int(s) for s in a.sizes.split(",")]
    rowgemm.activate(True)  # time the transposed product itself at every size; what tune() keeps is reported below
    kept = rowgemm.limits()
    rowgemm.set_limits({})
    modes = {"stock": rowgemm.disable, "rowgemm": rowgemm.enable}
    times = {m: {n: [] for n in sizes} for m in modes}
    for rep in tqdm(range(a.reps + 1), desc="rounds"):  # round 0 warms up
        for n in sizes:
            order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
            for m in order:
                modes[m](target.model)
                tree = chain(n)
                t0 = time.perf_counter()
                target.verify(tree)
                dt = time.perf_counter() - t0
                target.commit([0])
                target.cache.crop(target.length - 1)  # keep the prefix length fixed
                target.length -= 1
                if rep:
                    times[m][n].append(dt)
    rowgemm.enable(target.model)
    med = {m: {n: statistics.median(v) for n, v in t.items()} for m, t in times.items()}
    rows = [{"n": n, **{f"{m}_ms": round(med[m][n] * 1e3, 1) for m in modes},
             **{f"{m}_ratio": round(med[m][n] / med[m][1], 2) for m in modes},
             "speedup": round(med["stock"][n] / med["rowgemm"][n], 2)} for n in sizes]
    meta = {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv), "machine": f"{cpu_model()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}",
            "dtype": str(target.dtype).removeprefix("torch."), "date": time.strftime("%Y-%m-%d"), "reps": a.reps}
    rowgemm.set_limits(kept)  # what load_stack measured (or read from its cache) for this machine
    meta["rowgemm_rows"] = {f"{a}x{b}": r for (a, b), r in sorted(kept.items())}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Verify cost by tree size: stock nn.Linear vs rowgemm (W @ X^T)\n", f"Command: `{meta['command']}`  ",
          f"Machine: {meta['machine']}, {meta['dtype']}, {meta['date']}; median of {a.reps} interleaved runs.\n",
          "| nodes | stock ms | rowgemm ms | stock / 1-token | rowgemm / 1-token | rowgemm speedup |", "|---|---|---|---|---|---|"]
    md += [f"| {r['n']} | {r['stock_ms']} | {r['rowgemm_ms']} | {r['stock_ratio']} | {r['rowgemm_ratio']} | "
           f"{r['speedup']}x |" for r in rows]
    md.append("\nOne node runs the same kernel (F.linear) in both modes, so its speedup column shows this run's noise.")
    md.append("\nWhat the engine keeps here (`rowgemm.tune`: per weight shape, the most rows at which W @ X^T measured "
              f"{rowgemm.MARGIN}x faster than F.linear; float32 only): "
              + (", ".join(f"{k}: {v}" for k, v in meta["rowgemm_rows"].items()) or "nothing (not float32)") + ".")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
