"""Verify-forward cost on a CPU by tree size: SDPA with a bool tree mask (the default CPU path) against explicit
float32 products and the float64 ones of exact rows (`cpu_tree_attention`), interleaved, on the default target.

    python scripts/bench_cpu_attention.py            # contexts ~190 and ~590 tokens, sizes 2..256, 2 threads
Writes bench/results/cpu_attention.{json,md,png}: the min ms of one target verify forward over a bushy n-node tree
(4 children per node) after the context, per mode, and each mode's ratio to SDPA.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jetflow_sglang.kernels.hf_tree_attention as hta  # noqa: E402
from jetflow_sglang.machine import cpu_model  # noqa: E402
from jetflow_sglang.engine.stack import load_stack  # noqa: E402
from jetflow_sglang.core.tree import DraftTree  # noqa: E402

MODES = ("sdpa", "float32", "float64")


def float32_tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """cpu_tree_attention with float32 products and sums (tried as the default on 2026-12-03: no faster than SDPA)."""
    ctx = hta._CTX.get()
    if ctx is None:
        return hta.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
    b, _, n, _ = query.shape
    bias = hta._prepared(ctx, query.device, b, n, "bias").float()
    return hta.cpu_tree_attention(query, key, value, bias, scaling or query.shape[-1] ** -0.5), None


def bushy(n: int, rng: random.Random, vocab: int) -> DraftTree:
    tree = DraftTree.root(5)
    for i in range(1, n):
        tree.add(rng.randrange(vocab), (i - 1) // 4, 0.0)
    return tree


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8,16,32,64,256")
    ap.add_argument("--contexts", default="20,70", help="repeats of a one-sentence prompt (~190 and ~590 tokens)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_attention"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_stack(drafter="ar", dtype="auto")
    sizes = [int(s) for s in a.sizes.split(",")]
    rng = random.Random(0)
    vocab = int(target.config.vocab_size)
    rows = []
    for reps in [int(c) for c in a.contexts.split(",")]:
        ids = target.encode_chat("Write a long story about a dragon. " * reps)
        best = {(m, n): float("inf") for m in MODES for n in sizes}
        for rep in tqdm(range(a.reps + 1), desc=f"context {len(ids)}"):  # round 0 warms up
            for m in (MODES if rep % 2 == 0 else MODES[::-1]):
                hta.AttentionInterface.register(hta.NAME, float32_tree_attention if m == "float32"
                                                else hta.jetflow_tree_attention)
                target.exact = m == "float64"  # only the attention: the linears stay stock here
                target.prefill(ids)
                base = target.length
                for n in sizes:
                    tree = bushy(n, rng, vocab)
                    for _ in range(2):
                        target.cache.crop(base - target.cache.get_seq_length())
                        target.length = base
                        t0 = time.perf_counter()
                        target.verify(tree)
                        if rep:
                            best[m, n] = min(best[m, n], time.perf_counter() - t0)
        for n in sizes:
            rows.append({"context": len(ids), "nodes": n, **{f"{m}_ms": 1e3 * best[m, n] for m in MODES}})
    hta.AttentionInterface.register(hta.NAME, hta.jetflow_tree_attention)
    target.exact = False
    meta = {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
            "machine": f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                       f"{platform.python_version()}",
            "dtype": str(target.dtype).removeprefix("torch."), "date": time.strftime("%Y-%m-%d %H:%M"),
            "reps": a.reps}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# CPU verify forward: SDPA with a bool mask vs explicit float32 / float64 tree attention\n",
          f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
          f"- {meta['date']}; {meta['dtype']}; min of {a.reps} x 2 forwards per cell, modes interleaved; bushy trees\n",
          "| context | nodes | SDPA ms (default) | float32 ms | float64 ms (exact rows) | float32 / SDPA "
          "| float64 / SDPA |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['context']} | {r['nodes']} | {r['sdpa_ms']:.1f} | {r['float32_ms']:.1f} | "
                  f"{r['float64_ms']:.1f} | {r['float32_ms'] / r['sdpa_ms']:.2f} | "
                  f"{r['float64_ms'] / r['sdpa_ms']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({r["context"] for r in rows}), figsize=(11, 4), squeeze=False)
    for ax, ctx in zip(axes[0], sorted({r["context"] for r in rows})):
        sub = [r for r in rows if r["context"] == ctx]
        for m in MODES:
            ax.plot([r["nodes"] for r in sub], [r[f"{m}_ms"] for r in sub], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes")
        ax.set_ylabel("ms per verify forward")
        ax.set_title(f"{ctx} cached tokens")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"CPU tree attention ({meta['dtype']}, {meta['machine'].split(',')[0]})")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
