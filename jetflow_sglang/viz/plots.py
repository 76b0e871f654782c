"""Plotly figures of the acceptance diagnostics (diagnostics.py), for one drafter or several overlaid."""
from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import diagnostics as D

# one fixed colour and marker per drafter, everywhere in the explorer (live runs, comparisons, result files)
DRAFTER_COLOURS = {"jetflow": "#1f77b4", "jetflow+lookup": "#ff7f0e", "jetflow-branch": "#2ca02c", "ddtree": "#e4572e",
                   "dflash": "#9467bd", "ngram": "#8c564b", "ar": "#7f7f7f", "oracle": "#222222"}
DRAFTER_SYMBOLS = {"jetflow": "circle", "jetflow+lookup": "circle-open", "jetflow-branch": "diamond",
                   "ddtree": "square-open", "dflash": "triangle-up", "ngram": "x", "ar": "cross", "oracle": "star"}
_EXTRA = ["#17becf", "#bcbd22", "#e377c2", "#d62728"]


def drafter_colour(name: str, others: Sequence[str] = ()) -> str:
    if name in DRAFTER_COLOURS:
        return DRAFTER_COLOURS[name]
    unknown = sorted({o for o in others if o not in DRAFTER_COLOURS} | {name})
    return _EXTRA[unknown.index(name) % len(_EXTRA)]


DIAG_TRACES = ("by depth", "by rank", "calibration")


def diagnostics_figure(runs: dict[str, Sequence[tuple]], height: int = 330) -> go.Figure:
    """Acceptance by depth, by sibling rank (1 vs 2-8) and the calibration of the draft's per-step probability,
    one colour per run (`runs` maps a name to its (tree, path) rounds). Trace names: '<run> · <panel>'."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=(
        "acceptance by depth", "acceptance by sibling rank", "calibration: draft p vs accepted"))
    names = list(runs)
    for k, (name, rounds) in enumerate(runs.items()):
        rounds = list(rounds)
        colour = drafter_colour(name.split(" ")[0], [n.split(" ")[0] for n in names])
        depth, rank, cal = D.by_depth(rounds), D.by_rank(rounds), D.calibration(rounds)
        fig.add_trace(go.Scatter(
            x=[int(r.label) for r in depth], y=[r.rate for r in depth], mode="lines+markers", name=f"{name} · by depth",
            legendgroup=name, showlegend=False, line=dict(color=colour),
            text=[f"{r.accepted}/{r.tried}" for r in depth],
            hovertemplate="depth %{x}: %{y:.2f} (%{text} rounds)<extra>" + name + "</extra>"), row=1, col=1)
        fig.add_trace(go.Bar(
            x=[r.label for r in rank], y=[r.rate for r in rank], name=f"{name} · by rank", legendgroup=name,
            showlegend=False, marker_color=colour, text=[f"{r.accepted}/{r.tried}" for r in rank],
            textposition="outside", hovertemplate="%{x}: %{y:.2f} (%{text} tried)<extra>" + name + "</extra>"),
            row=1, col=2)
        fig.add_trace(go.Scatter(
            x=[b.mean_p for b in cal], y=[b.rate for b in cal], mode="lines+markers", name=f"{name} · calibration",
            legendgroup=name, showlegend=len(runs) > 1, line=dict(color=colour),
            marker=dict(size=[max(6, min(18, 4 + b.count ** 0.5)) for b in cal]),
            text=[f"[{b.lo:.1f}, {b.hi:.1f}): {b.accepted}/{b.count}" for b in cal],
            hovertemplate="draft p %{x:.2f} → accepted %{y:.2f}<br>bin %{text}<extra>" + name + "</extra>"),
            row=1, col=3)
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="calibrated", showlegend=False,
                             hoverinfo="skip", line=dict(color="#aaa", dash="dot")), row=1, col=3)
    fig.update_yaxes(range=[0, 1.08], title_text="accepted", row=1, col=1)
    fig.update_yaxes(range=[0, 1.15], row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=3)
    fig.update_xaxes(title_text="depth", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="sibling rank (by draft p)", row=1, col=2)
    fig.update_xaxes(title_text="draft per-step p (10 bins)", range=[0, 1], row=1, col=3)
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=40, b=40), barmode="group",
                      legend=dict(orientation="h", y=-0.28, x=0), plot_bgcolor="white")
    fig.update_xaxes(showgrid=True, gridcolor="#eee")
    fig.update_yaxes(showgrid=True, gridcolor="#eee")
    return fig
