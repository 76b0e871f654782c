"""End-to-end speed on GSM8K, MATH-500, HumanEval and MT-Bench: JetFlow against Hugging Face `generate`, greedy.

    python scripts/bench_e2e.py          # the issue's setting: 4 sets x 3 prompts, 128 new tokens, bf16, 2 threads
    python scripts/bench_e2e.py --sets gsm8k --limit 1 --max-new-tokens 16     # a smoke run

Everything runs in one process on one loaded model, interleaved per prompt (the method order rotates from prompt to
prompt, so drifting machine load hits every method alike), after one untimed warm-up run of each method. With
--repeats N every prompt runs every method N times (the order rotating again each time) and each (prompt, method)
keeps its fastest run: another process on a shared machine only ever adds time, so the minimum is the least noisy
estimate, and every method gets the same treatment (all N times are kept in the JSON):
  hf-ar                HF `generate`, greedy (the reference speed)
  hf-prompt-lookup     HF `generate` with prompt_lookup_num_tokens=10
  ar                   this project's plain decoding (engine.autoregressive)
  jetflow B=4, 8, 16   exact top-B trees        jetflow paper B=16   the paper's eager tree
  jetflow-branch B=16  branch-conditioned       ngram B=16           prompt lookup through the tree engine
  jetflow auto         --budget auto (AdaptiveBudget from a verify-cost prior measured afresh at the start)
  jetflow+lookup B=4, 8, 16, auto   the same with prompt-lookup tries merged into the trees (`jetflow generate`'s
                       default, drafters.WithLookup)
Speedups are total tokens / total seconds per set, against hf-ar, hf-prompt-lookup and ar. Also reported: whether
each output is identical to HF greedy and to our AR, the draft share of the round at B=16 (Round.draft_s over
draft_s + verify_s, as the engine times them), the budgets `auto` chose, and the batched tree builder's time
(tree_batch.build_topb, batch 8, B=256). Writes bench/results/e2e.{json,md,png} (or e2e_<tag>.*).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_tau import build_drafter, load_prompts  # noqa: E402
from jetflow_sglang.core import rowgemm  # noqa: E402
from jetflow_sglang.engine.profiling import measure_cost_prior  # noqa: E402
from jetflow_sglang.machine import cpu_model  # noqa: E402
from jetflow_sglang.draft.drafters import make_drafter  # noqa: E402
from jetflow_sglang.engine.loop import autoregressive, run  # noqa: E402

try:
    from jetflow_sglang.engine.stack import load_stack  # noqa: E402
except ImportError:  # before stack.py lands
    from jetflow_sglang.cli import load_stack  # noqa: E402

SETS = ("gsm8k", "math500", "humaneval", "mtbench")
# (label, kind, drafter, tree builder, budget)
METHODS = [
    ("hf-ar", "hf", None, None, 0),
    ("hf-prompt-lookup", "hf", None, None, 10),
    ("ar", "ar", None, None, 1),
    ("jetflow B=4", "spec", "jetflow", "exact", 4),
    ("jetflow B=8", "spec", "jetflow", "exact", 8),
    ("jetflow B=16", "spec", "jetflow", "exact", 16),
    ("jetflow paper B=16", "spec", "jetflow", "paper", 16),
    ("jetflow-branch B=16", "spec", "jetflow-branch", "exact", 16),
    ("ngram B=16", "spec", "ngram", "exact", 16),
    ("jetflow auto", "spec", "jetflow", "exact", "auto"),
    ("jetflow+lookup B=4", "spec", "jetflow+lookup", "exact", 4),
    ("jetflow+lookup B=8", "spec", "jetflow+lookup", "exact", 8),
    ("jetflow+lookup B=16", "spec", "jetflow+lookup", "exact", 16),
    ("jetflow+lookup auto", "spec", "jetflow+lookup", "exact", "auto"),
]
BASELINES = ("hf-ar", "hf-prompt-lookup", "ar")


def sync(target) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def hf_generate(target, prompt: list[int], max_new: int, lookup: int) -> tuple[list[int], float]:
    """HF `generate`, greedy; lookup > 0 turns on prompt-lookup decoding with that many tokens."""
    eos = sorted(target.eos_ids())
    ids = torch.tensor([prompt], device=target.device)
    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
              attention_mask=torch.ones_like(ids), temperature=None, top_p=None, top_k=None)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    sync(target)
    t0 = time.perf_counter()
    out = target.model.generate(ids, **kw)
    sync(target)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def run_method(method, target, drafters, prompt: list[int], max_new: int) -> dict:
    label, kind, name, tree, budget = method
    eos = target.eos_ids()
    if kind == "hf":  # Hugging Face's own paths, as a user runs them: stock nn.Linear (no rowgemm)
        rowgemm.disable(target.model)
        try:
            tokens, secs = hf_generate(target, prompt, max_new, budget)
        finally:
            rowgemm.enable(target.model)
        return {"tokens": tokens, "seconds": secs}
    if kind == "ar":
        res = autoregressive(target, prompt, max_new_tokens=max_new, eos_ids=eos)
        return {"tokens": res.tokens, "seconds": res.elapsed_s}
    res = run(target, drafters[(name, tree)], prompt, max_new_tokens=max_new, budget=budget, eos_ids=eos)
    spec = [r for r in res.rounds if r.tree is not None]
    return {"tokens": res.tokens, "seconds": res.elapsed_s, "tau": res.tau, "steps": res.steps,
            "draft_s": sum(r.draft_s for r in spec), "verify_s": sum(r.verify_s for r in spec),
            "budgets": [len(r.tree) for r in spec]}


def bench_drafter(name: str, tree: str, head, width: int):
    """The drafter of a method: ngram, a head drafter, or a head drafter with prompt lookup ("<name>+lookup")."""
    if name == "ngram":
        return make_drafter("ngram")
    base, lookup = name.removesuffix("+lookup"), name.endswith("+lookup")
    return make_drafter(base, head, None, width=width, tree=tree, lookup=True) if lookup else \
        build_drafter(base, head, None, width, tree)


def time_builder(batch: int = 8, budget: int = 256, depth: int = 16, width: int = 8, reps: int = 30) -> dict | None:
    """ms of tree_batch.build_topb for `batch` requests at `budget` (min and median of reps); None if not there."""
    try:
        from jetflow_sglang.core.tree_batch import build_topb
    except ImportError:
        return None
    gen = torch.Generator().manual_seed(0)
    logps = torch.rand(batch, depth, width, generator=gen).log().sort(-1, descending=True).values
    tokens = torch.randint(0, 1000, (batch, depth, width), generator=gen)
    anchor = torch.randint(0, 1000, (batch,), generator=gen)
    build_topb(anchor, tokens, logps, budget)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        build_topb(anchor, tokens, logps, budget)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"batch": batch, "budget": budget, "depth": depth, "width": width, "min_ms": times[0],
            "median_ms": times[len(times) // 2]}


def summarize(records: list[dict], sets: list[str]) -> dict:
    """Per set and over all: tok/s per method, speedups against the baselines, tau, identity, draft share."""
    out = {}
    for ds in list(sets) + ["all"]:
        rows = [r for r in records if ds == "all" or r["dataset"] == ds]
        by = collections.defaultdict(list)
        for r in rows:
            by[r["method"]].append(r)
        tps = {m: sum(len(r["tokens"]) for r in rs) / max(1e-9, sum(r["seconds"] for r in rs)) for m, rs in by.items()}
        cell = {}
        for m, rs in by.items():
            c = {"tok_s": tps[m], "prompts": len(rs),
                 "identical_to_hf": sum(r["identical_to_hf"] for r in rs), "identical_to_ar": sum(r["identical_to_ar"] for r in rs)}
            for base in BASELINES:
                if base in tps and tps[base] > 0:
                    c[f"vs_{base}"] = tps[m] / tps[base]
            if "tau" in rs[0]:
                c["tau"] = sum(r["tau"] * r["steps"] for r in rs) / max(1, sum(r["steps"] for r in rs))
                d, v = sum(r["draft_s"] for r in rs), sum(r["verify_s"] for r in rs)
                c["draft_share"] = d / (d + v) if d + v > 0 else 0.0
                c["mean_budget"] = sum(sum(r["budgets"]) for r in rs) / max(1, sum(len(r["budgets"]) for r in rs))
            cell[m] = c
        out[ds] = cell
    return out


DEFAULT = "jetflow+lookup auto"  # what `jetflow generate` runs


def bootstrap(records: list[dict], ds: str, method: str, base, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% paired-bootstrap interval of ratio() on set ds: prompts are resampled with replacement, each keeping
    all its methods' runs, so it shows how much a verdict hangs on which prompts happened to be drawn."""
    import random

    by = collections.defaultdict(list)
    for r in records:
        if r["dataset"] == ds:
            by[r["prompt"]].append(r)
    keys, rng, vals = sorted(by), random.Random(seed), []
    for _ in range(reps):
        vals.append(ratio([r for _ in keys for r in by[rng.choice(keys)]], method, base))
    vals.sort()
    return vals[int(0.05 * reps)], vals[int(0.95 * reps) - 1]


def ratio(rows: list[dict], method: str, base) -> float:
    """Total tok/s of method over that of base in rows (base: a list of methods -> the fastest of them)."""
    tps = lambda m: (sum(len(r["tokens"]) for r in rows if r["method"] == m)  # noqa: E731
                     / max(1e-9, sum(r["seconds"] for r in rows if r["method"] == m)))
    return tps(method) / max(tps(b) for b in ([base] if isinstance(base, str) else base))


def targets(records: list[dict], sets: list[str], methods: list[str]) -> list[dict]:
    """The issue's CPU targets for the default drafter, per set: value, 90% interval over prompts, verdict."""
    fixed = [m for m in methods if m.startswith("jetflow+lookup B=")] + (["ar"] if "ar" in methods else [])
    rows = []
    for ds in sets:
        want = [("hf-ar", 1.5), ("hf-prompt-lookup", 1.15)] if ds == "gsm8k" else [("hf-prompt-lookup", 1.0)]
        want += [(fixed, 0.9)] if fixed else []
        for base, bar in want:
            if DEFAULT not in methods or not all(b in methods for b in ([base] if isinstance(base, str) else base)):
                continue
            value = ratio([r for r in records if r["dataset"] == ds], DEFAULT, base)
            lo, hi = bootstrap(records, ds, DEFAULT, base)
            rows.append({"set": ds, "against": base if isinstance(base, str) else "best fixed budget",
                         "target": bar, "value": value, "ci90": [lo, hi],
                         "verdict": "met" if value >= bar else "missed",
                         "robust": lo >= bar if value >= bar else hi < bar})
    return rows


def markdown(meta: dict, summary: dict, builder: dict | None, auto_hist: dict, goals: list[dict] = ()) -> str:
    methods = [m[0] for m in METHODS]
    lines = ["# End to end: JetFlow vs Hugging Face `generate` (greedy)\n",
             f"- command: `{meta['command']}`", f"- machine: {meta['machine']}",
             f"- date: {meta['date']}; dtype {meta['dtype']}; {meta['max_new_tokens']} new tokens; "
             f"{meta['prompts_per_set']} prompts per set; width {meta['width']}; one process, interleaved per prompt, "
             "one untimed warm-up per method" + (f"; {meta['repeats']} runs of every method per prompt, the fastest "
             "counting" if meta.get("repeats", 1) > 1 else ""),
             "- speedup = total tokens / total seconds of the method over the same of the baseline, per set\n"]
    for ds, cell in summary.items():
        lines += [f"## {ds}\n", "| method | tok/s | vs HF AR | vs HF prompt lookup | vs own AR | tau | draft share | "
                  "mean budget | identical to HF / own AR |", "|---|---|---|---|---|---|---|---|---|"]
        for m in methods:
            if m not in cell:
                continue
            c = cell[m]
            f = lambda k, fmt: (fmt % c[k]) if k in c else "-"  # noqa: E731
            share = f"{100 * c['draft_share']:.1f}%" if "draft_share" in c else "-"
            lines.append(f"| {m} | {c['tok_s']:.2f} | {f('vs_hf-ar', '%.2fx')} | {f('vs_hf-prompt-lookup', '%.2fx')} | "
                         f"{f('vs_ar', '%.2fx')} | {f('tau', '%.2f')} | {share} | "
                         f"{f('mean_budget', '%.1f')} | {c['identical_to_hf']}/{c['prompts']} / "
                         f"{c['identical_to_ar']}/{c['prompts']} |")
        lines.append("")
    all_ = summary.get("all", {})
    for m in ("jetflow B=16", "jetflow+lookup B=16"):
        if m in all_ and "draft_share" in all_[m]:
            lines.append(f"- draft share of the round, {m} (all sets): {100 * all_[m]['draft_share']:.1f}% "
                         "(target: <= 10%)")
    for drafter in ("jetflow", "jetflow+lookup"):
        auto = f"{drafter} auto"
        if auto not in all_:
            continue
        for ds, cell in summary.items():  # fixed budgets of the same drafter: B=4, 8, 16, and 1 (= plain decoding)
            fixed = {m: c["tok_s"] for m, c in cell.items() if m.startswith(f"{drafter} B=") or m == "ar"}
            if fixed and auto in cell:
                best = max(fixed, key=fixed.get)
                lines.append(f"- {ds}: {auto} / best fixed budget ({best}) = {cell[auto]['tok_s'] / fixed[best]:.2f}"
                             f"; {auto} / own AR = {cell[auto].get('vs_ar', float('nan')):.2f} (targets >= 0.90, >= 1.00)")
        lines.append(f"- budgets {auto} chose (rounds): " + ", ".join(
            f"{b}: {n}" for b, n in sorted(auto_hist.get(auto, {}).items())))
    lines.append("- batched builder (tree_batch.build_topb), batch 8 at B=256: " + (
        f"{builder['min_ms']:.2f} ms min, {builder['median_ms']:.2f} ms median (target < 2 ms)" if builder
        else "not available (jetflow_sglang.core.tree_batch missing)"))
    if goals:
        lines += ["", f"## Targets ({DEFAULT}, the default drafter)\n",
                  "90% interval: paired bootstrap over the set's prompts (how much the verdict hangs on which prompts "
                  "were drawn); robust: the whole interval is on the verdict's side of the target.\n",
                  "| set | against | target | value | 90% interval | verdict |", "|---|---|---|---|---|---|"]
        for g in goals:
            lines.append(f"| {g['set']} | {g['against']} | >= {g['target']:.2f} | {g['value']:.3f} | "
                         f"{g['ci90'][0]:.3f}-{g['ci90'][1]:.3f} | {g['verdict']}"
                         f"{'' if g['robust'] else ' (not robust)'} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in summary if s != "all"] + ["all"]
    methods = [m[0] for m in METHODS if m[0] != "hf-ar" and m[0] in summary["all"]]  # the methods of this run
    colours = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.8))
    width = 0.8 / len(methods)
    for ax, base, title in ((axes[0], "hf-ar", "speedup over HF generate (greedy)"),
                            (axes[1], "hf-prompt-lookup", "speedup over HF prompt lookup (10 tokens)")):
        for i, m in enumerate(methods):
            ys = [summary[s].get(m, {}).get(f"vs_{base}", 0.0) for s in sets]
            xs = [j + (i - len(methods) / 2 + 0.5) * width for j in range(len(sets))]
            ax.bar(xs, ys, width, label=m, color=colours[i % len(colours)])
        ax.axhline(1.0, color="black", lw=1)
        ax.set_xticks(range(len(sets)), sets)
        ax.set_title(title)
        ax.set_ylabel("x (higher is faster)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = min(len(methods), 5)
    rows = -(-len(methods) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    fig.savefig(path, dpi=110)


def machine_info(target) -> str:
    import transformers

    return (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {platform.machine()}, "
            f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
            + (f", {torch.cuda.get_device_name()}" if target.device.type == "cuda" else ""))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--limit", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(m[0] for m in METHODS), help="comma-separated labels (see above)")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--head", default=None, help="draft head folder (default: the shipped head)")
    ap.add_argument("--target", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware runs it natively, else float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every method per prompt; the fastest counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="", help="write e2e_<tag>.* instead of e2e.*")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    known = {m[0] for m in METHODS}
    bad = [m for m in a.methods.split(",") if m not in known]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {sorted(known)}")
    bad = [s for s in a.sets.split(",") if s not in SETS]
    if bad:
        ap.error(f"unknown set(s) {bad}; choose from {list(SETS)}")
    if a.limit < 1 or a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--limit, --max-new-tokens and --repeats must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    methods = [m for m in METHODS if m[0] in a.methods.split(",")]
    sets = a.sets.split(",")
    target, jf = load_stack(a.target, a.head, dtype=a.dtype, drafter="jetflow", width=a.width, device=a.device,
                            lookup=False)  # the head alone; lookup variants are built from it
    head = jf.head
    drafters = {(m[2], m[3]): bench_drafter(m[2], m[3], head, a.width) for m in methods if m[1] == "spec"}
    prompts = [(ds, target.encode_chat(p)) for ds in sets for p in load_prompts(ds, a.limit)]
    prior = measure_cost_prior(target, refresh=True) if any(m[4] == "auto" for m in methods) else None

    for m in tqdm(methods, desc="warm-up"):  # one-time costs (allocations, auto's cost prior) stay out of the timing
        run_method(m, target, drafters, prompts[0][1], 8)
    records = []
    bar = tqdm(total=len(prompts) * len(methods) * a.repeats, desc="end to end")
    for k, (ds, prompt) in enumerate(prompts):
        got, times, agree = {}, collections.defaultdict(list), {}
        for rep in range(a.repeats):
            turn = (k * a.repeats + rep) % len(methods)
            for m in methods[turn:] + methods[:turn]:  # rotate: no method always runs first
                bar.set_postfix_str(f"{ds} #{k} {m[0]}" + (f" ({rep + 1}/{a.repeats})" if a.repeats > 1 else ""))
                r = run_method(m, target, drafters, prompt, a.max_new_tokens)
                times[m[0]].append(r["seconds"])
                agree[m[0]] = agree.get(m[0], True) and (m[0] not in got or r["tokens"] == got[m[0]]["tokens"])
                if m[0] not in got or r["seconds"] < got[m[0]]["seconds"]:
                    got[m[0]] = r  # the fastest run counts (greedy: every run emits the same tokens)
                bar.update()
        for name, secs in times.items():
            got[name]["seconds_all"] = secs
            got[name]["repeats_agree"] = agree[name]  # every run emitted the same tokens
        hf_ref, ar_ref = got.get("hf-ar", {}).get("tokens"), got.get("ar", {}).get("tokens")
        for m in methods:
            r = got[m[0]]
            records.append({"dataset": ds, "prompt": k, "method": m[0], **r,
                            "identical_to_hf": hf_ref is not None and r["tokens"] == hf_ref and r["repeats_agree"],
                            "identical_to_ar": ar_ref is not None and r["tokens"] == ar_ref and r["repeats_agree"]})
    bar.close()
    summary = summarize(records, sets)
    goals = targets(records, sets, [m[0] for m in methods])
    builder = time_builder()
    auto_hist = {m[0]: collections.Counter(b for r in records if r["method"] == m[0] for b in r["budgets"])
                 for m in methods if m[4] == "auto"}
    meta = {"command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
            "machine": machine_info(target), "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": str(target.dtype).removeprefix("torch."),
            "max_new_tokens": a.max_new_tokens, "prompts_per_set": a.limit, "width": a.width, "repeats": a.repeats,
            "target": str(target.config.architectures), "head": a.head or "default",
            "head_provenance": getattr(head.config, "extra", None), "methods": [m[0] for m in methods],
            "auto_cost_prior_s": prior}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "e2e" + (f"_{a.tag}" if a.tag else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "summary": summary, "builder": builder,
                                                  "auto_budgets": dict(auto_hist), "targets": goals,
                                                  "records": records}, indent=1))
    (out / f"{stem}.md").write_text(markdown(meta, summary, builder, auto_hist, goals))
    plot(summary, out / f"{stem}.png")
    print((out / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
