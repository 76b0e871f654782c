"""Export a run (every round: tree, target top-k, accepted path, timings) as JSON, and load it back.

The file carries the token texts it needs, so a reloaded run draws the same trees without the model.
"""
from __future__ import annotations

import json
from pathlib import Path

from jetflow_sglang.core.tree import DraftTree

from .session import RoundView, Session
from .target_view import TargetView

FORMAT = "jetflow-explorer-run/1"


def run_to_dict(s: Session, meta: dict | None = None) -> dict:
    rounds = []
    for r in s.rounds:
        t = r.tree
        rounds.append(dict(
            tree=dict(tokens=t.tokens, parents=t.parents, depths=t.depths, logps=[round(x, 6) for x in t.logps]),
            path=r.path, new_tokens=r.new_tokens, n_drafted=r.n_drafted, start=r.start,
            drafted_text=r.drafted_text, bonus_text=r.bonus_text,
            draft_s=round(r.draft_s, 6), verify_s=round(r.verify_s, 6),
            target_top=None if r.target is None else dict(
                ids=r.target.top_ids, probs=r.target.top_probs,
                node_p=[None if p is None else round(p, 6) for p in r.target.node_p])))
    return dict(format=FORMAT, meta=dict(meta or {}), prompt=s.prompt, settings=s.settings, text=s.text,
                first_text=s._first, tokens=s.tokens,
                stats=dict(rounds=len(s.rounds), tau=round(s.tau, 4), tokens_per_s=round(s.tokens_per_s, 3),
                           compute_s=round(s.compute_s, 6), ar_tokens_per_s=s.ar_tokens_per_s,
                           speedup=None if s.speedup is None else round(s.speedup, 4), ar_identical=s.ar_identical),
                labels={str(k): v for k, v in sorted(s.labels.items())}, rounds=rounds)


def save_run(s: Session, folder, meta: dict | None = None) -> Path:
    path = Path(folder) / f"jetflow-run-{s.drafter or 'run'}-{len(s.rounds)}rounds.json"
    path.write_text(json.dumps(run_to_dict(s, meta)))
    return path


def _tree(d: dict) -> DraftTree:
    tree = DraftTree([int(x) for x in d["tokens"]], [int(x) for x in d["parents"]], [int(x) for x in d["depths"]],
                     [float(x) for x in d["logps"]])
    n = len(tree.tokens)
    if not n or len(tree.parents) != n or len(tree.depths) != n or len(tree.logps) != n or tree.parents[0] != -1:
        raise ValueError("a round's tree has columns of different lengths or no root")
    if any(not 0 <= p < i for i, p in enumerate(tree.parents[1:], 1)):
        raise ValueError("a round's tree has a node before its parent")
    return tree


def run_from_dict(data: dict) -> Session:
    """A Session equal to the exported one (rounds, text, stats inputs); a clear ValueError on anything else."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not an exported explorer run (expected format {FORMAT!r})")
    try:
        settings = dict(data.get("settings") or {})
        s = Session(prompt=str(data.get("prompt", "")), drafter=str(settings.get("drafter", "")),
                    budget=int(settings.get("budget", 0)), settings=settings)
        s.labels = {int(k): str(v) for k, v in (data.get("labels") or {}).items()}
        s._tokens = [int(t) for t in data.get("tokens", [])]
        s._decoded, s._first = str(data.get("text", "")), str(data.get("first_text", ""))
        stats = data.get("stats") or {}
        s.compute_s = float(stats.get("compute_s") or 0.0)
        s.ar_tokens_per_s = stats.get("ar_tokens_per_s")
        s.ar_identical = stats.get("ar_identical")
        for r in data["rounds"]:
            tree = _tree(r["tree"])
            path = [int(i) for i in r["path"]]
            if not path or path[0] != 0 or any(not 0 <= i < len(tree) for i in path):
                raise ValueError("a round's accepted path leaves its tree")
            top = r.get("target_top")
            target = None if not top else TargetView([[int(t) for t in row] for row in top["ids"]],
                                                     [[float(p) for p in row] for row in top["probs"]],
                                                     [None if p is None else float(p) for p in top["node_p"]])
            s.rounds.append(RoundView(tree, path, [int(t) for t in r["new_tokens"]], str(r.get("drafted_text", "")),
                                      str(r.get("bonus_text", "")), int(r["n_drafted"]), float(r["draft_s"]),
                                      float(r["verify_s"]), target, int(r.get("start", 0))))
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"the exported run is incomplete or malformed ({type(e).__name__}: {e})") from None
    return s


def load_run(path) -> Session:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {Path(path).name}: {e}") from None
    return run_from_dict(data)
