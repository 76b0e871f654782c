"""Benchmark result files made readable: tau/speedup against budget (bench_tau.py) and serving throughput and
latency against concurrency (bench_serving.py).

Writers may change their layouts, so loading is tolerant: rows may sit at the top level, under "rows", "results" or
"data", or as a dict of columns; a few column names have aliases; metadata is read from "meta" when present.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .plots import DRAFTER_SYMBOLS, drafter_colour

TAU_LINE = ("**τ (tau)**: tokens committed per verify step (accepted draft tokens + the target's own token). "
            "**oracle**: the same tree builder fed with the target's own top-k distributions instead of a drafter: "
            "the τ a perfect drafter of that tree shape would reach. **speedup** over plain autoregressive decoding "
            "(modelled as τ × t_AR / (t_draft + t_verify) from costs measured in the same run, unless a row says e2e).")
SERVING_LINE = ("Throughput = output tokens / wall time over all requests at that concurrency; latency = per-request "
                "time to the last token. **accept length**: tokens per verify step as SGLang reports it.")
ALIASES = {
    "budget": ("budget", "B", "num_draft_tokens", "tree_budget"),
    "tau": ("tau", "accept_length", "tau_mean", "acceptance_length"),
    "speedup": ("speedup", "speedup_model", "speedup_vs_ar"),
    "drafter": ("drafter", "method", "algorithm"),
    "dataset": ("dataset", "data", "bench"),
    "config": ("config", "name", "setting"),
    "concurrency": ("concurrency", "clients", "batch", "parallel"),
    "throughput": ("output_tok_per_s", "throughput", "tok_per_s", "output_throughput"),
    "latency": ("latency_mean_s", "latency_s", "mean_latency_s", "latency"),
    "latency_p50": ("latency_p50_s", "p50_latency_s"),
}
ALL = "all datasets (line style per dataset)"
_DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]


@dataclass
class ResultFile:
    name: str                  # path relative to the results folder
    kind: str                  # "tau" or "serving"
    rows: list[dict]
    meta: dict = field(default_factory=dict)
    e2e: list[dict] = field(default_factory=list)

    @property
    def datasets(self) -> list[str]:
        return sorted({str(r["dataset"]) for r in self.rows if r.get("dataset") is not None})

    def title(self) -> str:
        machine = self.meta.get("machine") or self.meta.get("device") or "machine not recorded"
        date = self.meta.get("date") or "date not recorded"
        return f"{self.name} · {machine} · {date}"


def pick(row: dict, key: str):
    for k in ALIASES.get(key, (key,)):
        if row.get(k) is not None:
            return row[k]
    return None


def num(row: dict, key: str) -> float | None:
    try:
        v = float(pick(row, key))
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _rows(data) -> list:
    if isinstance(data, dict):
        for key in ("rows", "results", "data"):
            if isinstance(data.get(key), list):
                return data[key]
        cols = {k: v for k, v in data.items() if isinstance(v, list)}
        if cols and len({len(v) for v in cols.values()}) == 1:
            n = len(next(iter(cols.values())))
            return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    return data if isinstance(data, list) else []


def load_file(path, name: str | None = None) -> ResultFile:
    """A tau or serving result file; ValueError with a clear message when it is neither."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path.name}: {e}") from None
    rows = [r for r in _rows(data) if isinstance(r, dict)]
    meta = data.get("meta") if isinstance(data, dict) and isinstance(data.get("meta"), dict) else {}
    name = name or path.name
    serving = [r for r in rows if num(r, "concurrency") is not None and num(r, "throughput") is not None]
    tau = [r for r in rows if num(r, "budget") is not None]
    if serving and len(serving) >= len(tau):
        return ResultFile(name, "serving", serving, meta)
    if tau:
        e2e = data.get("e2e") if isinstance(data, dict) and isinstance(data.get("e2e"), list) else []
        return ResultFile(name, "tau", tau, meta, [r for r in e2e if isinstance(r, dict)])
    raise ValueError(f"{name}: no rows with a budget (tau results) or a concurrency and a throughput "
                     "(serving results)")


def _log_ticks(values: Sequence[float]) -> dict:
    vals = sorted(set(values))
    return dict(type="log", tickvals=vals, ticktext=[f"{v:g}" for v in vals])


def tau_figure(rf: ResultFile, dataset: str | None = None) -> go.Figure:
    """tau and speedup against the budgets that were run. One colour (and marker) per drafter; `dataset` picks one
    dataset, or ALL draws every dataset with its own line style."""
    datasets = rf.datasets or [""]
    chosen = datasets if dataset in (None, ALL) else [dataset]
    if dataset not in (None, ALL) and dataset not in datasets:
        raise ValueError(f"{rf.name} has no dataset {dataset!r}; it has {', '.join(datasets)}")
    drafters = sorted({str(pick(r, "drafter") or "?") for r in rf.rows})
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("τ (tokens per verify step)", "speedup over autoregressive"))
    budgets = []
    for d_i, ds in enumerate(chosen):
        for name in drafters:
            pts = sorted((num(r, "budget"), num(r, "tau"), num(r, "speedup")) for r in rf.rows
                         if str(pick(r, "drafter") or "?") == name and str(pick(r, "dataset") or "") == ds)
            if not pts:
                continue
            budgets += [p[0] for p in pts]
            label = name if len(chosen) == 1 else f"{name} · {ds}"
            style = dict(color=drafter_colour(name, drafters), dash=_DASHES[d_i % len(_DASHES)], width=2)
            marker = dict(symbol=DRAFTER_SYMBOLS.get(name, "circle"), size=9, line=dict(width=1.5, color=style["color"]))
            for col, j in ((1, 1), (2, 2)):
                xy = [(p[0], p[j]) for p in pts if p[j] is not None]
                if xy:
                    fig.add_trace(go.Scatter(
                        x=[x for x, _ in xy], y=[y for _, y in xy], mode="lines+markers", name=label,
                        legendgroup=label, showlegend=col == 1, line=style, marker=marker,
                        hovertemplate=f"{label}<br>budget %{{x}}: %{{y:.2f}}<extra></extra>"), row=1, col=col)
    fig.add_hline(y=1.0, line=dict(color="#999", dash="dot"), row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text="budget (tree nodes)", **_log_ticks(budgets), row=1, col=col)
    shown = "all datasets" if len(chosen) > 1 else (chosen[0] or "")
    fig.update_layout(title=dict(text=f"{rf.title()}<br><sup>{shown}</sup>", font=dict(size=15)), height=430,
                      margin=dict(l=10, r=10, t=80, b=40), plot_bgcolor="white",
                      legend=dict(orientation="v", x=1.02, y=1, xanchor="left", font=dict(size=11)))
    fig.update_xaxes(showgrid=True, gridcolor="#eee")
    fig.update_yaxes(showgrid=True, gridcolor="#eee")
    return fig


def serving_figure(rf: ResultFile) -> go.Figure:
    """Throughput and mean latency against concurrency, one colour per configuration."""
    configs = sorted({str(pick(r, "config") or "?") for r in rf.rows}, key=lambda c: (c != "baseline", c))
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("throughput (output tokens/s)", "mean latency per request (s)"))
    palette = ["#7f7f7f", "#1f77b4", "#2ca02c", "#e4572e", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]
    levels = []
    for k, c in enumerate(configs):
        pts = sorted((num(r, "concurrency"), num(r, "throughput"), num(r, "latency"), num(r, "latency_p50"),
                      num(r, "tau")) for r in rf.rows if str(pick(r, "config") or "?") == c)
        levels += [p[0] for p in pts]
        colour = palette[k % len(palette)]
        acc = [p[4] for p in pts if p[4] is not None]
        label = c + (f" (accept length {sum(acc) / len(acc):.2f})" if acc else "")
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=label,
                                 legendgroup=c, line=dict(color=colour, width=2),
                                 hovertemplate=f"{c}<br>concurrency %{{x}}: %{{y:.1f}} tok/s<extra></extra>"),
                      row=1, col=1)
        lat = [(p[0], p[2]) for p in pts if p[2] is not None]
        fig.add_trace(go.Scatter(x=[x for x, _ in lat], y=[y for _, y in lat], mode="lines+markers",
                                 name=f"{c} latency", legendgroup=c, showlegend=False, line=dict(color=colour, width=2),
                                 hovertemplate=f"{c}<br>concurrency %{{x}}: %{{y:.2f}} s<extra></extra>"),
                      row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text="concurrent requests", **_log_ticks(levels), row=1, col=col)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title=dict(text=rf.title(), font=dict(size=15)), height=430, plot_bgcolor="white",
                      margin=dict(l=10, r=10, t=70, b=40),
                      legend=dict(orientation="v", x=1.02, y=1, xanchor="left", font=dict(size=11)))
    fig.update_xaxes(showgrid=True, gridcolor="#eee")
    fig.update_yaxes(showgrid=True, gridcolor="#eee")
    return fig


def _r(v, nd):
    if v is None:
        return None
    return int(round(v)) if nd == 0 else round(v, nd)


TAU_COLUMNS = ["dataset", "drafter", "budget", "tau", "speedup"]
SERVING_COLUMNS = ["config", "concurrency", "tok/s", "latency mean s", "latency p50 s", "accept length"]


def table(rf: ResultFile, dataset: str | None = None) -> list[list]:
    """Rounded rows for the page's table (2 decimals; tokens/s 1)."""
    if rf.kind == "serving":
        return [[pick(r, "config"), _r(num(r, "concurrency"), 0), _r(num(r, "throughput"), 1),
                 _r(num(r, "latency"), 2), _r(num(r, "latency_p50"), 2), _r(num(r, "tau"), 2)] for r in rf.rows]
    rows = [r for r in rf.rows if dataset in (None, ALL) or str(pick(r, "dataset") or "") == dataset]
    return [[pick(r, "dataset"), pick(r, "drafter"), _r(num(r, "budget"), 0), _r(num(r, "tau"), 2),
             _r(num(r, "speedup"), 2)] for r in rows]


def e2e_markdown(rf: ResultFile) -> str:
    """The end-to-end measured runs a tau file may carry, one line each."""
    lines = []
    for r in rf.e2e:
        b, tau, sp = num(r, "budget"), num(r, "tau"), num(r, "speedup")
        if b is None:
            continue
        same = r.get("identical_to_ar")
        where = f"{r['dataset']} " if r.get("dataset") else ""
        lines.append(f"{where}budget {b:g}: τ {tau:.2f}, measured speedup {sp:.2f}x" if tau is not None and sp is not None
                     else f"budget {b:g}: incomplete row")
        if same is not None:
            lines[-1] += f", identical to AR: {same}"
    return ("**end to end, measured** (" + str(pick(rf.e2e[0], "drafter") or "jetflow") + "): " + "; ".join(lines)) \
        if lines else ""
