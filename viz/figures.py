"""Plotly figures for the explorer: the draft tree of one round, accept-length histogram, budget sweeps.

Pure functions of plain data (a DraftTree, a list of node indices, rows of numbers) so they are unit-testable
without a model or a browser.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import networkx as nx
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from jetflow_sglang.tree import DraftTree

ACCEPT = "#e4572e"      # accepted path (edges, node outlines)
DIM_EDGE = "rgba(120,120,120,0.25)"
MAX_LABELS = 96         # above this many nodes only the accepted path keeps its text label
# Trace names are part of the contract: the browser test finds the tree's traces by these names.
NODES, PATH, EDGES, PATH_EDGES = "draft nodes", "accepted path", "rejected edges", "accepted edges"


def token_label(text: str, limit: int = 12) -> str:
    """Make a token visible on a plot: show spaces and newlines, shorten long pieces."""
    text = text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def tree_graph(tree: DraftTree) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(tree)))
    g.add_edges_from((p, i) for i, p in enumerate(tree.parents) if p >= 0)
    return g


def tree_layout(tree: DraftTree) -> dict[int, tuple[float, float]]:
    """Layered tidy layout: x = depth, leaves take consecutive rows in DFS order (children sorted by draft
    log-prob, best on top) and each parent sits at the mean row of its children, so subtrees never cross."""
    g = tree_graph(tree)
    order = {i: -tree.logps[i] for i in range(len(tree))}
    ys: dict[int, float] = {}
    next_row = 0.0
    for node in nx.dfs_postorder_nodes(g, 0, sort_neighbors=lambda ns: sorted(ns, key=order.get)):
        kids = list(g.successors(node))
        if kids:
            ys[node] = sum(ys[k] for k in kids) / len(kids)
        else:
            ys[node], next_row = next_row, next_row + 1.0
    return {i: (float(tree.depths[i]), -ys[i]) for i in range(len(tree))}


def _edge_xy(pos, edges: Iterable[tuple[int, int]]) -> tuple[list, list]:
    xs, ys = [], []
    for a, b in edges:  # None breaks the line between segments: one trace draws every edge
        xs += [pos[a][0], pos[b][0], None]
        ys += [pos[a][1], pos[b][1], None]
    return xs, ys


def tree_figure(tree: DraftTree, path: Sequence[int] | None = None,
                decode: Callable[[int], str] | None = None, title: str | None = None) -> go.Figure:
    """The round's draft tree. Node colour = draft probability exp(cumulative logp); the accepted `path`
    (root first, node indices) is drawn thick and outlined, everything off it is dimmed."""
    path = list(path or [])
    on_path = set(path)
    bad = [i for i in path if not 0 <= i < len(tree)]
    if bad:
        raise ValueError(f"accepted path has nodes {bad} outside the tree (size {len(tree)})")
    decode = decode or (lambda t: str(t))
    pos = tree_layout(tree)
    n = len(tree)
    words = [decode(t) for t in tree.tokens]
    labels = [token_label(w) if (n <= MAX_LABELS or i in on_path) else "" for i, w in enumerate(words)]
    prob = [math.exp(lp) for lp in tree.logps]
    hover = [f"token {w!r} (id {t})<br>depth {d}<br>cum. log-prob {lp:.3f} (p={p:.3g})"
             + ("<br><b>accepted</b>" if i in on_path else "")
             for i, (w, t, d, lp, p) in enumerate(zip(words, tree.tokens, tree.depths, tree.logps, prob))]

    path_edges = {(a, b) for a, b in zip(path, path[1:])}
    edges = [(p, i) for i, p in enumerate(tree.parents) if p >= 0]
    ex, ey = _edge_xy(pos, [e for e in edges if e not in path_edges])
    px, py = _edge_xy(pos, [e for e in edges if e in path_edges])
    # one row per leaf: size the plot by leaves and the markers by the row pitch, so siblings do not overlap
    leaves = sum(1 for i in range(n) if not tree.children(i))
    height = max(360, min(1000, 22 * leaves + 100))
    size = max(5.0, min(22.0, 0.8 * (height - 100) / max(1, leaves)))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", name=EDGES, hoverinfo="skip",
                             line=dict(color=DIM_EDGE, width=1)))
    fig.add_trace(go.Scatter(x=px, y=py, mode="lines", name=PATH_EDGES, hoverinfo="skip",
                             line=dict(color=ACCEPT, width=4)))
    fig.add_trace(go.Scatter(
        x=[pos[i][0] for i in range(n)], y=[pos[i][1] for i in range(n)], mode="markers+text",
        name=NODES, text=labels, textposition="middle right", hovertext=hover, hoverinfo="text",
        textfont=dict(size=11 if size >= 14 else 9),
        marker=dict(size=size, color=prob, colorscale="Viridis", cmin=0.0, cmax=1.0,
                    opacity=[1.0 if (i in on_path or not path) else 0.35 for i in range(n)],
                    colorbar=dict(title=dict(text="draft p"), thickness=12, len=0.6),
                    line=dict(width=0)),
        customdata=list(range(n))))
    fig.add_trace(go.Scatter(  # drawn on top: the accepted nodes, outlined
        x=[pos[i][0] for i in path], y=[pos[i][1] for i in path], mode="markers", name=PATH,
        hovertext=[hover[i] for i in path], hoverinfo="text", customdata=path,
        marker=dict(size=size + 6, color="rgba(0,0,0,0)", line=dict(color=ACCEPT, width=3))))
    fig.update_layout(
        title=title, showlegend=False, plot_bgcolor="white", margin=dict(l=10, r=10, t=40 if title else 10, b=30),
        height=height,
        xaxis=dict(title="depth", dtick=1, zeroline=False, showgrid=True, gridcolor="#eee"),
        yaxis=dict(visible=False), hoverlabel=dict(font_size=12))
    return fig


def accept_histogram(accept_lengths: Sequence[int]) -> go.Figure:
    """Tokens committed per round (accepted drafts + the bonus token)."""
    counts: dict[int, int] = defaultdict(int)
    for a in accept_lengths:
        counts[int(a)] += 1
    xs = sorted(counts)
    fig = go.Figure(go.Bar(x=xs, y=[counts[x] for x in xs], marker_color=ACCEPT, name="rounds"))
    fig.update_layout(height=260, margin=dict(l=10, r=10, t=30, b=30), title="tokens per round",
                      xaxis=dict(title="tokens committed", dtick=1), yaxis=dict(title="rounds"))
    return fig


def _num(row: dict, key: str) -> float | None:
    try:
        v = float(row[key])
    except (KeyError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def sweep_figure(rows: Sequence[dict], title: str | None = None) -> go.Figure:
    """tau and speedup over AR against the budget, one line per (dataset, drafter). Rows missing a budget
    are skipped; a row without speedup still appears in the tau panel."""
    series: dict[str, list[tuple[float, float | None, float | None]]] = defaultdict(list)
    for r in rows:
        b = _num(r, "budget")
        if b is None:
            continue
        name = str(r.get("drafter", "?"))
        if r.get("dataset"):
            name = f"{r['dataset']} / {name}"
        series[name].append((b, _num(r, "tau"), _num(r, "speedup")))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tau (tokens per round)", "speedup over AR"))
    for k, (name, pts) in enumerate(sorted(series.items())):
        pts.sort()
        color = _PALETTE[k % len(_PALETTE)]
        for col, j in ((1, 1), (2, 2)):
            xy = [(p[0], p[j]) for p in pts if p[j] is not None]
            if xy:
                fig.add_trace(go.Scatter(x=[x for x, _ in xy], y=[y for _, y in xy], mode="lines+markers",
                                         name=name, legendgroup=name, showlegend=col == 1,
                                         line=dict(color=color)), row=1, col=col)
    fig.add_hline(y=1.0, line=dict(color="#999", dash="dot"), row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(type="log", title_text="budget (nodes)", row=1, col=col)
    fig.update_layout(title=title, height=380, margin=dict(l=10, r=10, t=60, b=30), legend=dict(orientation="h"))
    return fig


_PALETTE = ["#1f77b4", "#e4572e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
