"""Would per-request tree sizes beat one budget per batch? An estimate from a budget sweep of scripts/bench_serving.py.

SGLang 0.5.23's DSPARK verifies a different number of tokens per request in one batch ("ragged" verify). For a mixed
batch (--concurrency requests, the same number k from each --sets workload: math, chat and code together), this
compares
  uniform: the best single budget b for every request:   k sum_s tau_s(b)   / round_s(k sum_s b)
  ragged:  the best budget per request b_s:              k sum_s tau_s(b_s) / round_s(k sum_s b_s)
where tau_s(b) is the accept length the sweep measured on workload s at concurrency --concurrency and fixed budget b
(jetflow-bN rows), and round_s(n) the median round time (/server_info's round_split: head, tree, verify, accept,
commit) of those rows, interpolated in the number of verified tokens n. It is a model of a batch built from measured
curves, not a measurement of a ragged server: it bounds what ragged verify could gain before anyone builds it.

    python scripts/bench_ragged.py bench/results/sglang_budget_sweep.json --concurrency 4
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from jetflow_sglang.core.budget import interp_cost


def curves(results: list[dict], concurrency: int) -> tuple[dict, dict]:
    """({workload: {budget: accept length}}, {verified tokens per round: median round seconds})."""
    tau, cost = {}, {}
    for r in results:
        name, c = r["config"], r["concurrency"]
        if c != concurrency or not name.startswith("jetflow-b") or not name[9:].isdigit():
            continue
        b = int(name[9:])
        tau.setdefault(r["workload"], {})[b] = 1.0 if b == 1 else r["accept_length"]
        splits = [sum(j["round_split"].values()) for j in r.get("round_jetflow", []) if j.get("round_split")]
        if splits:
            cost.setdefault(b * concurrency, []).append(statistics.median(splits))
    return tau, {n: statistics.median(v) for n, v in cost.items()}


def estimate(tau: dict, cost: dict, concurrency: int) -> dict:
    """The batch holds `concurrency` requests, the same number from each workload (the costs were measured at that
    batch size)."""
    sets = sorted(tau)
    if concurrency % len(sets):
        raise ValueError(f"{len(sets)} workloads cannot share a batch of {concurrency} evenly")
    k = concurrency // len(sets)
    budgets = sorted(set.intersection(*(set(t) for t in tau.values())))
    rate = lambda bs: k * sum(tau[s][b] for s, b in zip(sets, bs)) / interp_cost(cost, k * sum(bs))  # noqa: E731
    uniform = max(((b,) * len(sets) for b in budgets), key=rate)
    ragged = max(itertools.product(budgets, repeat=len(sets)), key=rate)
    return {"sets": sets, "budgets": budgets, "round_s": cost, "tau": tau,
            "uniform": {"budgets": dict(zip(sets, uniform)), "tokens_per_s": round(rate(uniform), 2)},
            "ragged": {"budgets": dict(zip(sets, ragged)), "tokens_per_s": round(rate(ragged), 2)},
            "gain": round(rate(ragged) / rate(uniform), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="a bench_serving.py JSON with jetflow-bN rows on several --sets workloads")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", help="default: <sweep>_ragged (.json and .md)")
    a = ap.parse_args(argv)
    data = json.loads(Path(a.sweep).read_text())
    tau, cost = curves(data["results"], a.concurrency)
    if len(tau) < 2 or len(cost) < 2:
        ap.error(f"{a.sweep} needs jetflow-bN rows (at least two budgets) on at least two workloads at concurrency "
                 f"{a.concurrency}")
    try:
        est = {"sweep": a.sweep, "concurrency": a.concurrency, **estimate(tau, cost, a.concurrency)}
    except ValueError as e:
        ap.error(str(e))
    out = Path(a.out or str(Path(a.sweep).with_suffix("")) + "_ragged")
    out.with_suffix(".json").write_text(json.dumps(est, indent=2))
    lines = [f"# Per-request budgets vs one budget per batch (estimate from `{a.sweep}`, concurrency {a.concurrency})",
             "", "A mixed batch with the same number of requests from each workload; accept lengths and round times as the sweep measured them "
             "at fixed budgets (scripts/bench_ragged.py). A model, not a ragged server.", "",
             "| workload | " + " | ".join(f"tau at {b}" for b in est["budgets"]) + " | uniform | ragged |",
             "|---|" + "---|" * (len(est["budgets"]) + 2)]
    for s in est["sets"]:
        lines.append(f"| {s} | " + " | ".join(f"{tau[s][b]:.2f}" for b in est["budgets"]) +
                     f" | {est['uniform']['budgets'][s]} | {est['ragged']['budgets'][s]} |")
    lines += ["", "Round seconds by verified tokens: " + ", ".join(f"{n}: {v * 1000:.0f} ms" for n, v in
                                                                 sorted(cost.items())), "",
              f"Output tokens per second of the mixed batch: uniform {est['uniform']['tokens_per_s']}, ragged "
              f"{est['ragged']['tokens_per_s']}: **{est['gain']:.3f}x**."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
