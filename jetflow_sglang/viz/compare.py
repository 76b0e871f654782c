"""Two drafters side by side on the same prompt and settings: aligned rounds and a one-line comparison."""
from __future__ import annotations

from dataclasses import dataclass, field

from .session import Session


@dataclass
class Pair:
    a: Session = field(default_factory=Session)
    b: Session = field(default_factory=Session)
    stop_requested: bool = False

    @property
    def running(self) -> bool:
        return self.a.running or self.b.running


def aligned_round(a: Session, b: Session, k: int) -> int:
    """The round of `b` (1-based) that covers the output position where round `k` of `a` starts: both then draft
    the continuation of the same text (identical at temperature 0). 0 when `b` has no rounds."""
    if not b.rounds or not a.rounds:
        return 0
    start = a.rounds[max(1, min(k, len(a.rounds))) - 1].start
    best = 1
    for j, r in enumerate(b.rounds, 1):
        if r.start <= start:
            best = j
        else:
            break
    return best


def summary(s: Session, name: str) -> str:
    if not s.rounds:
        return f"**{name}**: no rounds yet"
    sp = f" · speedup {s.speedup:.2f}x" if s.speedup is not None else ""
    state = "running · " if s.running else ""
    return (f"**{name}** `{s.drafter}` · {state}rounds {len(s.rounds)} · tokens {s.n_tokens} · **τ {s.tau:.2f}** · "
            f"**{s.tokens_per_s:.1f} tok/s**{sp}")
