"""A tree budget that adapts to acceptance and load.

The best budget maximises tokens per second: batch * tau(B) / (t_draft + t_verify(batch * B)). Both sides are learnt
online, for free:
- tau(b) for every b <= B comes out of each verified tree: trees are grown best-first, so the first b nodes of a
  budget-B tree are exactly the budget-b tree, and its accepted length is the deepest accepted node with index < b;
- t_verify(n) is measured per verify forward and kept per bucket of verified tokens (batch * tree size).
Budgets above the current choice are explored now and then, so estimates stay fresh and the budget can grow again
when load drops.
"""
from __future__ import annotations

import math
import random

from .tree import MAX_BUDGET, check_budget

LADDER = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _bucket(n_tokens: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n_tokens))))


class AdaptiveBudget:
    def __init__(self, max_budget: int = 256, min_budget: int = 1, decay: float = 0.95, explore: float = 0.05, seed: int = 0):
        check_budget(max_budget)
        check_budget(min_budget)
        if min_budget > max_budget:
            raise ValueError(f"min_budget {min_budget} > max_budget {max_budget}")
        self.ladder = [b for b in LADDER if min_budget <= b <= max_budget] or [max_budget]
        self.decay, self.explore = decay, explore
        self.accepted = {b: 0.0 for b in self.ladder}  # decayed sums of accepted tokens (bonus included) per round
        self.rounds = {b: 0.0 for b in self.ladder}
        self.verify_s: dict[int, float] = {}  # bucket of verified tokens -> decayed mean seconds
        self.draft_s = 0.0
        self.rng = random.Random(seed)

    def tau(self, b: int) -> float | None:
        return self.accepted[b] / self.rounds[b] if self.rounds[b] > 0.5 else None

    def cost(self, n_tokens: int) -> float | None:
        known = sorted(self.verify_s)
        if not known:
            return None
        bucket = _bucket(n_tokens)
        if bucket in self.verify_s:
            return self.verify_s[bucket]
        lo = max([k for k in known if k < bucket], default=None)
        hi = min([k for k in known if k > bucket], default=None)
        if lo is None:
            return self.verify_s[hi]  # no smaller measurement: verify cost never drops below a larger tree's... nearly
        if hi is None:  # beyond measurements: grow linearly from the largest (verify becomes compute-bound)
            return self.verify_s[lo] * bucket / lo
        w = (math.log2(bucket) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return self.verify_s[lo] * (1 - w) + self.verify_s[hi] * w

    def choose(self, batch: int = 1) -> int:
        tried = [b for b in self.ladder if self.tau(b) is not None]
        if not tried:
            return self.ladder[-1]  # the first round measures every smaller budget at once

        def rate(b):
            c = self.cost(batch * b)
            return batch * self.tau(b) / (self.draft_s + c) if c else 0.0
        best = max(tried, key=rate)
        bigger = [b for b in self.ladder if b > best]
        if bigger and self.rng.random() < self.explore:  # refresh what a larger tree would accept now
            return self.rng.choice(bigger[:2])
        return best

    def observe(self, accepted_node_ids: list[int], budget: int, batch: int, verify_s: float, draft_s: float = 0.0) -> None:
        """accepted_node_ids: the accepted path of one request (root first, tree node indices); budget: its tree size."""
        for b in self.ladder:
            if b > budget:
                break
            depth = sum(1 for i in accepted_node_ids[1:] if i < b)  # nodes < b on a prefix-closed path form its prefix
            self.accepted[b] = self.decay * self.accepted[b] + depth + 1
            self.rounds[b] = self.decay * self.rounds[b] + 1
        key = _bucket(batch * budget)
        old = self.verify_s.get(key)
        self.verify_s[key] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        self.draft_s = 0.8 * self.draft_s + 0.2 * draft_s if self.draft_s else draft_s


def parse_budget(value) -> int | str:
    """An int in [1, 512] or 'auto'."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return check_budget(int(value))


__all__ = ["AdaptiveBudget", "LADDER", "MAX_BUDGET", "parse_budget"]
