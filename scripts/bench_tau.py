"""tau and speedup vs budget for every drafter and both tree builders on GSM8K, MATH-500, HumanEval and MT-Bench.

    python scripts/bench_tau.py                       # the issue's full setting: 40 prompts x 4 sets, 256 new tokens
    python scripts/bench_tau.py --limit 10 --max-new-tokens 128   # what fits in ~30 CPU minutes

tau comes from the exact offline walk (jetflow_sglang.engine.offline): the target's greedy continuation (unbatched greedy
decoding, one prompt at a time, so no left-padding changes it) decides every round, so no verify forward is needed per
drafter and budget. Tree drafters (jetflow, ddtree) run with both builders: the exact top-B builder (the default) and
the paper's eager form (rows named "<drafter> (paper tree)"), so the head's gain and the builder's gain are separate.
The oracle (the target's own top-k along its path) always uses the exact builder: it is the ceiling. Speedup over autoregressive uses costs measured in this run on
this machine: t_AR per token, t_verify(N) for the tree sizes, and each drafter's own draft time:
    speedup = tau * t_AR / (t_draft + t_verify(mean nodes))
`--e2e K` also times real end-to-end generation (engine vs autoregressive) on K GSM8K prompts, side by side; the
fair end-to-end comparison against Hugging Face `generate` and prompt lookup is scripts/bench_e2e.py.
Writes bench/results/tau.{json,md,png}.
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

from jetflow_sglang.machine import cpu_model  # noqa: E402
from jetflow_sglang.draft.drafters import make_drafter  # noqa: E402
from jetflow_sglang.engine.loop import autoregressive, run  # noqa: E402
from jetflow_sglang.head import load_head  # noqa: E402
from jetflow_sglang.engine.offline import OracleDrafter, walk  # noqa: E402
from jetflow_sglang.paths import DEFAULT_HEAD_DIR  # noqa: E402
from jetflow_sglang.engine.target import Target  # noqa: E402
from jetflow_sglang.core.tree import DraftTree  # noqa: E402

try:
    from jetflow_sglang.engine.stack import load_stack, pick_head  # noqa: E402
except ImportError:  # before stack.py lands
    from jetflow_sglang.cli import load_stack  # noqa: E402
    pick_head = None

TREE_DRAFTERS = ("jetflow", "ddtree")  # drafters whose tree builder is a choice (branch: exact; dflash: a chain)

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
FORMATS = {
    "gsm8k": lambda p: p + REASON,
    "math500": lambda p: p + REASON,
    "humaneval": lambda p: "Complete the following Python function.\n\n```python\n" + p + "```",
    "mtbench": lambda p: p,
}


def load_prompts(name: str, limit: int) -> list[str]:
    rows = [json.loads(line) for line in open(ROOT / "bench" / "data" / f"{name}.jsonl")]
    return [FORMATS[name](r["prompt"]) for r in rows[:limit]]


def references(target: Target, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The target's greedy continuations: unbatched greedy decoding, exactly what plain decoding emits."""
    eos = target.eos_ids()
    return [autoregressive(target, p, max_new_tokens=max_new, eos_ids=eos).tokens
            for p in tqdm(prompts, desc="references", leave=False)]


def build_drafter(name: str, head, bidir, width: int, tree: str = "exact"):
    """make_drafter with a tree builder ("exact" | "paper")."""
    import inspect

    if "tree" in inspect.signature(make_drafter).parameters:
        return make_drafter(name, head, bidir, width=width, tree=tree)
    d = make_drafter(name, head, bidir, width=width)  # make_drafter before `tree=`: the builder was the `eager` flag
    if hasattr(d, "eager"):
        d.eager = tree == "paper"
    return d


def oracle(logits, width: int):
    """The oracle drafter on the exact builder."""
    import inspect

    params = inspect.signature(OracleDrafter).parameters
    return OracleDrafter(logits, width=width, **({"tree": "exact"} if "tree" in params else {"eager": False}))


def drafter_specs(names: list[str]) -> list[tuple[str, str, str]]:
    """(row label, drafter name, builder) for every drafter, both builders for tree drafters."""
    specs = []
    for n in names:
        specs.append((n, n, "exact"))
        if n in TREE_DRAFTERS:
            specs.append((f"{n} (paper tree)", n, "paper"))
    return specs


def load_heads(a) -> tuple[Target, object, object]:
    """(target, causal head, bidirectional head or None) through the one assembly point."""
    target, jf = load_stack(a.target, a.head, dtype=a.dtype, drafter="jetflow", width=a.width, device=a.device,
                            lookup=False)  # the head alone; lookup variants are built from it
    head, bidir = jf.head, None
    if pick_head is not None:
        bdir, bcfg, _ = pick_head(a.head, "ddtree", target.config)
        bidir = load_head(bdir, target) if not bcfg.causal else None
    return target, head, bidir


def machine(target: Target) -> str:
    import os

    return (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {platform.machine()}, "
            f"python {platform.python_version()}, torch {torch.__version__}"
            + (f", {torch.cuda.get_device_name()}" if target.device.type == "cuda" else ""))


def sync(target: Target) -> None:
    if target.device.type == "cuda":  # kernels run asynchronously: time what finished, not what was queued
        torch.cuda.synchronize()


def time_costs(target: Target, prompt: list[int], sizes: list[int], reps: int = 5) -> dict:
    """min-of-reps ms for one AR token and for verifying trees of each size, interleaved so load hits all alike."""
    target.prefill(prompt)
    best = {n: float("inf") for n in sizes}
    for _ in range(reps):
        for n in sizes:
            tree = DraftTree.root(prompt[-1])
            for i in range(1, n):
                tree.add(prompt[i % len(prompt)], (i - 1) // 4, 0.0)  # bushy: 4 children per node
            sync(target)
            t0 = time.perf_counter()
            target.verify(tree)
            sync(target)
            best[n] = min(best[n], (time.perf_counter() - t0) * 1000)
            target.commit([0])
    return best


def interp(costs: dict, n: float) -> float:
    xs = sorted(costs)
    for lo, hi in zip(xs, xs[1:]):
        if lo <= n <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)
    return costs[xs[-1]] * n / xs[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="gsm8k,math500,humaneval,mtbench")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budgets", default="16,32,64,128,256")
    ap.add_argument("--drafters", default="jetflow,jetflow-branch,ddtree,dflash,ngram,oracle")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--head", default=str(DEFAULT_HEAD_DIR))
    ap.add_argument("--target", default=None)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware runs it natively, else float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--batch", type=int, default=20, help="unused: references are unbatched greedy decoding now")
    ap.add_argument("--e2e", type=int, default=2, help="GSM8K prompts timed end to end (0: skip)")
    ap.add_argument("--e2e-budgets", default="16,32", help="budgets timed end to end")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--merge", nargs="+", metavar="TAU_JSON",
                    help="only combine tau.json files of partial runs (e.g. datasets split over two processes)")
    a = ap.parse_args()
    if a.merge:
        return merge(a.merge, Path(a.out), [int(b) for b in a.budgets.split(",")])
    torch.set_num_threads(a.threads)
    budgets = [int(b) for b in a.budgets.split(",")]
    names = a.drafters.split(",")

    target, head, bidir = load_heads(a)
    specs = drafter_specs(names)
    drafters = {label: build_drafter(n, head, bidir, a.width, tree) for label, n, tree in specs if n != "oracle"}

    rows, per_prompt, warm = [], [], set()
    for ds in a.datasets.split(","):
        prompts = [target.encode_chat(p) for p in load_prompts(ds, a.limit)]
        refs = references(target, prompts, a.max_new_tokens)
        cells: dict[tuple[str, int], list] = {}
        for prompt, ref in tqdm(list(zip(prompts, refs)), desc=ds):
            if len(ref) < 2:
                continue
            logits, taps = target.prefill(prompt + ref, all_logits=True)
            for name, base, _ in specs:
                d = oracle(logits, a.width) if base == "oracle" else drafters[name]
                if name not in warm:  # one untimed walk first: one-time costs (GPU kernel selection) stay out
                    walk(d, prompt, ref[:8], taps, max(budgets))
                    warm.add(name)
                for b in budgets if base != "dflash" else [b for b in budgets if b <= 16] or budgets[:1]:
                    w = walk(d, prompt, ref, taps, b)
                    cells.setdefault((name, b), []).append(w)
        for (name, b), ws in cells.items():
            steps = sum(w.steps for w in ws)
            rows.append({"dataset": ds, "drafter": name, "budget": b, "prompts": len(ws),
                         "tau": sum(w.tokens for w in ws) / steps, "mean_nodes": sum(w.nodes for w in ws) / steps,
                         "draft_ms": 1000 * sum(w.draft_s for w in ws) / steps})
            per_prompt.append({"dataset": ds, "drafter": name, "budget": b, "tau": [round(w.tau, 4) for w in ws]})

    sizes = sorted({1, 16, 32, 64, 128, 256} | set(budgets))
    calib = target.encode_chat(load_prompts("gsm8k", 1)[0])
    calib = calib + references(target, [calib], 200)[0]
    costs = time_costs(target, calib, sizes)
    for r in rows:
        draft = 0.0 if r["drafter"] == "oracle" else r["draft_ms"]
        r["verify_ms"] = interp(costs, r["mean_nodes"])
        r["speedup"] = r["tau"] * costs[1] / (draft + r["verify_ms"])

    e2e = []
    if a.e2e:
        eos = target.eos_ids()
        for prompt in tqdm([target.encode_chat(p) for p in load_prompts("gsm8k", a.e2e)], desc="end to end"):
            autoregressive(target, prompt, max_new_tokens=4)  # warm-up
            ar = autoregressive(target, prompt, max_new_tokens=a.max_new_tokens, eos_ids=eos)
            spec = drafters.get("jetflow") or make_drafter("ngram")
            for b in [int(x) for x in a.e2e_budgets.split(",")]:
                run(target, spec, prompt, max_new_tokens=8, budget=b)  # warm-up (GPU: kernel compiles)
                res = run(target, spec, prompt, max_new_tokens=a.max_new_tokens, budget=b, eos_ids=eos)
                e2e.append({"budget": b, "tau": res.tau, "tokens": len(res.tokens), "ar_tok_s": ar.tokens_per_s,
                            "spec_tok_s": res.tokens_per_s, "speedup": res.tokens_per_s / ar.tokens_per_s,
                            "identical_to_ar": res.tokens == ar.tokens})

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv), "machine": machine(target),
            "references": "unbatched greedy decoding (engine.autoregressive)", "oracle_builder": "exact",
            "date": time.strftime("%Y-%m-%d %H:%M"), "target": str(target.config.architectures), "dtype": str(target.dtype).removeprefix("torch."),
            "head": a.head or "default", "head_provenance": head.config.extra, "cost_ms": costs, "width": a.width}
    (out / "tau.json").write_text(json.dumps({"meta": meta, "rows": rows, "per_prompt": per_prompt, "e2e": e2e}, indent=1))
    (out / "tau.md").write_text(markdown(meta, rows, e2e, budgets))
    plot(rows, out / "tau.png")
    print((out / "tau.md").read_text())
    return 0


def merge(paths, out: Path, budgets) -> int:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    for p in parts:
        p["meta"]["cost_ms"] = {int(k): v for k, v in p["meta"]["cost_ms"].items()}
    meta = dict(parts[0]["meta"])
    meta["command"] = " ; ".join(p["meta"]["command"] for p in parts) + " ; python scripts/bench_tau.py --merge " + \
        " ".join(str(x) for x in paths)
    meta["parts"] = [p["meta"] for p in parts]
    rows = [r for p in parts for r in p["rows"]]
    e2e = [r for p in parts for r in p["e2e"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tau.json").write_text(json.dumps({"meta": meta, "rows": rows, "e2e": e2e,
                                              "per_prompt": [r for p in parts for r in p["per_prompt"]]}, indent=1))
    (out / "tau.md").write_text(markdown(meta, rows, e2e, budgets))
    plot(rows, out / "tau.png")
    print((out / "tau.md").read_text())
    return 0


def markdown(meta, rows, e2e, budgets) -> str:
    lines = [f"# tau and speedup vs budget (greedy)\n", f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
             f"- date: {meta['date']}; dtype {meta['dtype']}; width {meta['width']}",
             f"- measured costs (ms, min of 5): AR token {meta['cost_ms'][1]:.1f}; verify " +
             ", ".join(f"N={n}: {v:.1f}" for n, v in meta["cost_ms"].items() if n != 1),
             "- speedup = tau x t_AR / (t_draft + t_verify(mean tree size)), all measured in the same run; oracle has no draft cost.\n"]
    for part in meta.get("parts", [])[1:]:
        lines.insert(5, f"- costs of the other part (ms): AR token {part['cost_ms'][1]:.1f}; verify " +
                     ", ".join(f"N={n}: {v:.1f}" for n, v in part["cost_ms"].items() if n != 1))
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        lines += [f"## {ds}\n", "| drafter | " + " | ".join(f"B={b}" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for name in dict.fromkeys(r["drafter"] for r in rows):
            cells = {r["budget"]: r for r in rows if r["dataset"] == ds and r["drafter"] == name}
            lines.append(f"| {name} | " + " | ".join(
                f"{cells[b]['tau']:.2f} / {cells[b]['speedup']:.2f}x" if b in cells else "-" for b in budgets) + " |")
        lines.append("\ncells: tau / modelled speedup over AR\n")
    if e2e:
        lines += ["## End to end on GSM8K (engine vs autoregressive, same run)\n",
                  "| budget | tau | tokens | AR tok/s | JetFlow tok/s | speedup | identical to AR |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['budget']} | {r['tau']:.2f} | {r['tokens']} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['identical_to_ar']} |" for r in e2e]
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(2, len(sets), figsize=(4.2 * len(sets), 7), squeeze=False)
    for j, ds in enumerate(sets):
        for name in dict.fromkeys(r["drafter"] for r in rows):
            pts = sorted((r["budget"], r["tau"], r["speedup"]) for r in rows if r["dataset"] == ds and r["drafter"] == name)
            if pts:
                b, t, s = zip(*pts)
                style = "--" if name == "oracle" else ":" if "paper" in name else "-"
                axes[0][j].plot(b, t, style, marker="o", label=name)
                axes[1][j].plot(b, s, style, marker="o", label=name)
        axes[0][j].set_title(ds)
        for i, lab in enumerate(["tau (tokens / verify step)", "speedup over AR (modelled)"]):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xlabel("budget (tree nodes)")
            axes[i][j].set_ylabel(lab)
            axes[i][j].grid(alpha=0.3)
        axes[1][j].axhline(1.0, color="grey", lw=0.8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
