"""The one table of drafters: name -> what it needs and where it runs. The CLI, `load_stack`, the server config, the
SGLang worker, the explorer and the benchmarks all ask it; adding a drafter is one row here plus its class.

Imports nothing (the server's launcher reads it before any model code).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    head: str | None  # "causal" | "bidirectional" | None (needs no head)
    mode: str | None  # how a head drafts (drafters.HeadDrafter): "tree" (top-B), "branch", "chain"; None: no head
    server: bool  # the batched SGLang worker runs it (else: CLI and Python API only)
    summary: str


REGISTRY: dict[str, DrafterSpec] = {s.name: s for s in (
    DrafterSpec("jetflow", "causal", "tree", True, "causal parallel head, best-first top-B tree"),
    DrafterSpec("jetflow-branch", "causal", "branch", False, "causal head, a second pass per branch (CLI only)"),
    DrafterSpec("ddtree", "bidirectional", "tree", True, "bidirectional (DFlash-style) head, top-B tree"),
    DrafterSpec("dflash", "bidirectional", "chain", True, "bidirectional head, its argmax chain"),
    DrafterSpec("ngram", None, None, True, "prompt lookup: continuations of earlier repeats of the context"),
    DrafterSpec("ar", None, None, True, "no drafting: plain decoding through the same loop"),
)}

TREES = ("exact", "paper")  # tree builders: the exact top-B (default; the server's only one) and the paper's eager form
DEFAULT_WIDTH = 8  # children considered per tree node (--width, --speculative-eagle-topk)
DRAFTERS = tuple(REGISTRY)
HEAD_DRAFTERS = tuple(n for n, s in REGISTRY.items() if s.head)
CAUSAL_DRAFTERS = tuple(n for n, s in REGISTRY.items() if s.head == "causal")
BIDIRECTIONAL_DRAFTERS = tuple(n for n, s in REGISTRY.items() if s.head == "bidirectional")
SERVER_DRAFTERS = tuple(n for n, s in REGISTRY.items() if s.server)
CLI_ONLY_DRAFTERS = tuple(n for n, s in REGISTRY.items() if not s.server)


def spec(name: str) -> DrafterSpec:
    """The row of `name`; an unknown name is a one-line ValueError listing the registry's names."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}") from None


__all__ = ["BIDIRECTIONAL_DRAFTERS", "CAUSAL_DRAFTERS", "CLI_ONLY_DRAFTERS", "DEFAULT_WIDTH", "DRAFTERS", "DrafterSpec",
           "HEAD_DRAFTERS", "REGISTRY", "SERVER_DRAFTERS", "TREES", "spec"]
