"""Plotly figures for the explorer: the draft tree of one round, accept-length histogram, budget sweeps.

Pure functions of plain data (a DraftTree, a list of node indices, rows of numbers) so they are unit-testable
without a model or a browser.
"""
from __future__ import annotations

import html
import math
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import networkx as nx
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from jetflow_sglang.core.tree import DraftTree

from .diagnostics import sibling_ranks, step_probs

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


COLOURS = ("draft", "target", "agreement")
COLOUR_HELP = {
    "draft": "draft p (per step)",
    "target": "target p (per step)",
    "agreement": "log10 p_target / p_draft",
}
COLLAPSE_MIN = 64       # trees up to this size are always drawn whole
MORE, TARGET_PICK = "collapsed", "target's token"


def visible_nodes(tree: DraftTree, path: Sequence[int], threshold: float = 0.0,
                  zoom: bool = False) -> tuple[list[int], dict[int, int]]:
    """Which nodes to draw, and per drawn parent how many nodes are folded into one "+k more" node.

    zoom: the accepted path and the alternatives the target saw (children of path nodes) only. Otherwise a node is
    folded, with its subtree, when its cumulative draft probability is below `threshold`. The accepted path is
    never folded."""
    on_path = set(path)
    size = [1] * len(tree)
    for i in range(len(tree) - 1, 0, -1):
        size[tree.parents[i]] += size[i]
    shown = [True] * len(tree)
    folded: dict[int, int] = {}
    for i in range(1, len(tree)):
        p = tree.parents[i]
        if not shown[p]:
            shown[i] = False
            continue
        keep = i in on_path or (p in on_path if zoom else math.exp(tree.logps[i]) >= threshold)
        if not keep:
            shown[i] = False
            folded[p] = folded.get(p, 0) + size[i]
    return [i for i in range(len(tree)) if shown[i]], folded


def _node_hover(tree: DraftTree, i: int, words, step_p, ranks, status, view, decode) -> str:
    lines = [f"<b>{html.escape(repr(words[i]), quote=False)}</b> (id {tree.tokens[i]}) · depth {tree.depths[i]}"]
    if i == 0:
        lines.append("anchor: the last committed token")
    else:
        lines.append(f"draft p {step_p[i]:.3g} (sibling rank {ranks[i]}) · cum. log-prob {tree.logps[i]:.3f} "
                     f"(p={math.exp(tree.logps[i]):.3g})")
        if view is not None:
            tp = view.node_p[i]
            row_p = view.top_probs[tree.parents[i]]
            lines.append(f"<b>target p {tp:.3g}</b>" if tp is not None
                         else f"target p below {row_p[-1]:.3g} (not in its top-{len(row_p)})")
    lines.append(status[i])
    if view is not None:
        row = tree.parents[i] if i else 0
        which = "target's top-5 here" if i else "target's top-5 next"
        top = ", ".join(f"{html.escape(repr(decode(t)), quote=False)} {p:.2f}"
                        for t, p in zip(view.top_ids[row][:5], view.top_probs[row][:5]))
        lines.append(f"{which}: {top}")
    return "<br>".join(lines)


def _colours(mode: str, step_p, view, n: int):
    """Numbers to colour by, and the colour axis. Per-step probabilities, never cumulative ones."""
    if mode not in COLOURS:
        raise ValueError(f"colour must be one of {COLOURS}; got {mode!r}")
    if mode == "draft" or view is None:
        return list(step_p), dict(colorscale="Viridis", cmin=0.0, cmax=1.0), COLOUR_HELP["draft"]
    tgt = [1.0 if i == 0 else (view.node_p[i] if view.node_p[i] is not None else 0.0) for i in range(n)]
    if mode == "target":
        return tgt, dict(colorscale="Viridis", cmin=0.0, cmax=1.0), COLOUR_HELP["target"]
    ratio = [max(-3.0, min(3.0, math.log10(max(t, 1e-12) / max(d, 1e-12)))) for t, d in zip(tgt, step_p)]
    return ratio, dict(colorscale="RdBu", cmin=-3.0, cmax=3.0, cmid=0.0), COLOUR_HELP["agreement"]


def tree_figure(tree: DraftTree, path: Sequence[int] | None = None,
                decode: Callable[[int], str] | None = None, title: str | None = None, view=None,
                colour: str = "draft", target_token: int | None = None, threshold: float = 0.0,
                zoom: bool = False, height: int | None = None) -> go.Figure:
    """The round's draft tree. Node colour = per-step probability (`colour`: draft, target, or their log ratio);
    the accepted `path` (root first, node indices) is drawn thick and outlined, everything off it is dimmed.
    `view` (target_view.TargetView) adds the target's probability and top-5 to every node's hover;
    `target_token` (the token the target chose at the first rejection) is drawn as a star after the last accepted
    node. Trees over COLLAPSE_MIN nodes fold branches below `threshold`, or everything off the path when `zoom`."""
    path = list(path or [])
    on_path = set(path)
    bad = [i for i in path if not 0 <= i < len(tree)]
    if bad:
        raise ValueError(f"accepted path has nodes {bad} outside the tree (size {len(tree)})")
    decode = decode or (lambda t: str(t))
    n = len(tree)
    if n > COLLAPSE_MIN and (threshold > 0 or zoom):
        shown, folded = visible_nodes(tree, path, threshold, zoom)
    else:
        shown, folded = list(range(n)), {}
    # lay out the drawn nodes plus one "+k more" placeholder per folded parent, as a smaller tree
    sub = DraftTree.root(tree.tokens[0])
    new_id = {0: 0}
    for i in shown[1:]:
        new_id[i] = sub.add(tree.tokens[i], new_id[tree.parents[i]], tree.logps[i])
    more = {p: sub.add(-1, new_id[p], float("-inf")) for p in folded}
    spos = tree_layout(sub)
    pos = {i: spos[new_id[i]] for i in shown}

    words = {i: decode(tree.tokens[i]) for i in shown}
    m = len(shown)
    labels = [token_label(words[i]) if (m <= MAX_LABELS or i in on_path) else "" for i in shown]
    step_p = step_probs(tree)
    ranks = sibling_ranks(tree)
    tried = {k for p in path for k in tree.children(p)}
    status = ["<b>accepted</b>" if i in on_path else ("rejected by the target" if i in tried
              else "not tested (parent rejected)") for i in range(n)]
    hover = {i: _node_hover(tree, i, words, step_p, ranks, status, view, decode) for i in shown}
    values, axis, ctitle = _colours(colour, step_p, view, n)

    path_edges = {(a, b) for a, b in zip(path, path[1:])}
    edges = [(tree.parents[i], i) for i in shown[1:]]
    ex, ey = _edge_xy(pos, [e for e in edges if e not in path_edges])
    px, py = _edge_xy(pos, [e for e in edges if e in path_edges])
    mpos = {("m", p): spos[k] for p, k in more.items()}
    mx, my = _edge_xy({**pos, **mpos}, [(p, ("m", p)) for p in more])
    leaves = sum(1 for i in range(len(sub)) if not sub.children(i))
    height = height or max(360, 22 * leaves + 100)
    size = max(5.0, min(22.0, 0.8 * (height - 100) / max(1, leaves)))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ex + mx, y=ey + my, mode="lines", name=EDGES, hoverinfo="skip",
                             line=dict(color=DIM_EDGE, width=1)))
    fig.add_trace(go.Scatter(x=px, y=py, mode="lines", name=PATH_EDGES, hoverinfo="skip",
                             line=dict(color=ACCEPT, width=4)))
    fig.add_trace(go.Scatter(
        x=[pos[i][0] for i in shown], y=[pos[i][1] for i in shown], mode="markers+text",
        name=NODES, text=labels, textposition="middle right", hovertext=[hover[i] for i in shown],
        hoverinfo="text", textfont=dict(size=11 if size >= 14 else 9),
        marker=dict(size=size, color=[values[i] for i in shown], **axis,
                    opacity=[1.0 if (i in on_path or not path) else 0.45 for i in shown],
                    colorbar=dict(title=dict(text=ctitle, side="right"), thickness=12, len=0.6),
                    line=dict(width=0)),
        customdata=shown))
    fig.add_trace(go.Scatter(  # drawn on top: the accepted nodes, outlined
        x=[pos[i][0] for i in path], y=[pos[i][1] for i in path], mode="markers", name=PATH,
        hovertext=[hover[i] for i in path], hoverinfo="text", customdata=path,
        marker=dict(size=size + 6, color="rgba(0,0,0,0)", line=dict(color=ACCEPT, width=3))))
    if more:
        fig.add_trace(go.Scatter(
            x=[mpos[("m", p)][0] for p in more], y=[mpos[("m", p)][1] for p in more], mode="markers+text",
            name=MORE, text=[f"+{k} more" for k in folded.values()], textposition="middle right",
            hovertext=[f"{k} nodes folded (draft p below {threshold:g})" if not zoom else f"{k} nodes off the path"
                       for k in folded.values()], hoverinfo="text", customdata=list(folded.values()),
            textfont=dict(size=10, color="#666"), marker=dict(size=8, color="#bbb", symbol="square")))
    if path and target_token is not None:
        last = path[-1]
        tp = None
        if view is not None and target_token in view.top_ids[last]:
            tp = view.top_probs[last][view.top_ids[last].index(target_token)]
        word = decode(target_token)
        tip = (f"the target chose <b>{html.escape(repr(word), quote=False)}</b> (id {target_token})"
               + (f", p {tp:.3g}" if tp is not None else "") + " after the last accepted node")
        fig.add_trace(go.Scatter(
            x=[pos[last][0] + 0.5], y=[pos[last][1]], mode="markers+text", name=TARGET_PICK,
            text=[f"target: {token_label(word)}"], textposition="top center", hovertext=[tip], hoverinfo="text",
            customdata=[target_token], textfont=dict(size=11, color=ACCEPT),
            marker=dict(size=16, symbol="star", color="#ffd23f", line=dict(color=ACCEPT, width=1.5))))
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)) if title else None, showlegend=False, plot_bgcolor="white",
        margin=dict(l=10, r=10, t=40 if title else 10, b=30), height=height,
        # room on the right for the deepest labels and the "+k more" notes
        xaxis=dict(title="depth", dtick=1, zeroline=False, showgrid=True, gridcolor="#eee",
                   range=[-0.3, max(tree.depths[i] for i in shown) + (1.6 if more else 0.9)]),
        yaxis=dict(visible=False), hoverlabel=dict(font_size=12, align="left"))
    return fig


def accept_histogram(accept_lengths: Sequence[int]) -> go.Figure:
    """Tokens committed per round (accepted drafts + the bonus token)."""
    counts: dict[int, int] = defaultdict(int)
    for a in accept_lengths:
        counts[int(a)] += 1
    xs = sorted(counts)
    fig = go.Figure(go.Bar(x=xs, y=[counts[x] for x in xs], marker_color=ACCEPT, name="rounds"))
    fig.update_layout(height=240, margin=dict(l=10, r=10, t=30, b=30), title="tokens committed per round",
                      plot_bgcolor="white",
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
