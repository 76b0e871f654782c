"""Budget sweeps for the explorer: run one prompt at several budgets, or load the benchmark's result files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from jetflow_sglang.engine.loop import run

BUDGETS = (1, 16, 32, 64, 128, 256)
KEYS = ("dataset", "drafter", "budget", "tau", "speedup")


def sweep(target, drafters: dict, prompt_ids: Sequence[int], max_new_tokens: int, budgets: Sequence[int] = BUDGETS,
          temperature: float = 0.0, eos_ids=(), dataset: str = "prompt",
          progress: Callable[[int, int, str], None] | None = None,
          should_stop: Callable[[], bool] | None = None) -> list[dict]:
    """tau and measured speedup over autoregressive (the `ar` drafter through the same loop, so both pay the same
    Python overhead) for each drafter and budget. `drafters` maps name -> drafter; `progress(done, total, what)`."""
    from jetflow_sglang.draft.drafters import make_drafter

    jobs = [("ar", make_drafter("ar"), 1)] + [(n, d, b) for n, d in drafters.items() for b in budgets]
    rows, ar_tps = [], None
    for k, (name, drafter, budget) in enumerate(jobs):
        if should_stop and should_stop():
            break
        if progress:
            progress(k, len(jobs), f"{name} @ budget {budget}")
        res = run(target, drafter, list(prompt_ids), max_new_tokens=max_new_tokens, budget=budget,
                  temperature=temperature, eos_ids=eos_ids)
        if name == "ar" and ar_tps is None:
            ar_tps = res.tokens_per_s
            continue
        rows.append(dict(dataset=dataset, drafter=name, budget=budget, tau=round(res.tau, 3),
                         tokens_per_s=round(res.tokens_per_s, 2),
                         speedup=round(res.tokens_per_s / ar_tps, 3) if ar_tps else None,
                         tokens=len(res.tokens)))
    if progress:
        progress(len(jobs), len(jobs), "done")
    return rows


def list_results(folder) -> list[str]:
    """Result files in `folder` and its sub-folders (bench/results/h200/ holds the GPU run)."""
    folder = Path(folder)
    return sorted(str(p) for p in folder.rglob("*.json")) if folder.is_dir() else []


def load_results(path) -> list[dict]:
    """Rows from a benchmark result file. Tolerant of the layouts a writer might pick: a list of row dicts,
    {"rows"|"results": [...]}, or a dict of columns. Rows without a budget are dropped (they cannot be plotted)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if isinstance(data, dict):
        for key in ("rows", "results", "data"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            cols = {k: v for k, v in data.items() if isinstance(v, list)}
            if cols and len({len(v) for v in cols.values()}) == 1:
                n = len(next(iter(cols.values())))
                data = [{k: v[i] for k, v in cols.items()} for i in range(n)]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of rows with keys {', '.join(KEYS)}")
    rows = [r for r in data if isinstance(r, dict) and r.get("budget") is not None]
    if not rows:
        raise ValueError(f"{path}: no rows with a budget (expected keys {', '.join(KEYS)})")
    return rows
