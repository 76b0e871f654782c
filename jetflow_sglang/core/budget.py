"""A tree budget that adapts to acceptance and cost, and never loses to plain decoding.

The best budget maximises tokens per second: batch * tau(b) / (t_draft(b) + t_verify(batch * b)).
- tau(b) for every b <= B comes out of each verified tree: trees are grown best-first, so the first b nodes of a
  budget-B tree are exactly the budget-b tree, and its accepted length is the deepest accepted node with index < b.
  tau(1) = 1 exactly (budget 1 is a root-only tree: plain decoding, no head forward); budget 0 (allow_zero, SGLang)
  is plain decoding without any verify tree, also tau = 1.
- t_verify(n) starts from a cost prior (measured verify forwards at a few sizes, engine.profiling's
  `measure_cost_prior`, or a given {tokens: seconds} dict) and is replaced by the measured cost per bucket of
  verified tokens as rounds come in (an exponential mean in which one slow round counts as at most SPIKE times the
  estimate: see _learn). Its first WARM_SAMPLES measurements keep their minimum instead (load only adds time), and
  while the plain step has fewer than WARM_SAMPLES, it is probed again after PROBE_EVERY // 16 rounds whenever it
  would be the best budget at BURST times less cost. One slow first plain probe (another process on a shared CPU)
  priced plain decoding at 3x for 64 rounds and more, and kept a server at batch 4 on trees slower than plain
  decoding (tests/test_budget.py).
  Measured costs (verify and draft) are kept per bucket of batch size: one head forward drafts the whole batch and
  the same tokens cost more spread over more requests, so what a server learnt at batch 8 must not price batch 1
  when the load falls (a batch size without measurements borrows the nearest one's).
- The first budget is the prior's best, never above 16 and never the largest. Larger budgets are explored only when
  their optimistic rate (an upper confidence bound on tau, extrapolated with diminishing returns from the largest
  observed budget) beats the current best by the hysteresis margin, so exploration stops once it is ruled out
  (regret grows like log(rounds)), and only while the time exploration lost against the best budget so far stays
  under EXPLORE_FRAC of the elapsed time (plus one round): a ledger that bounds the loss against plain decoding even
  when the confidence bounds are too optimistic. Rounds of plain decoding age what the trees taught (their counts
  in the confidence width decay per plain round): an unlucky start that sent auto to plain decoding is retried after a
  few rounds instead of once log(rounds) has grown enough (up to 65 rounds in a simulated chat opening).
  The current budget is kept unless another one is better by the hysteresis margin, except against plain decoding:
  a tree is kept only while it is estimated to beat it (staying on a tree within the margin would lose up to the
  margin against plain decoding on every round).
- The plain step (the lowest rung) is never priced by extrapolation alone: while the best budget is a tree, one plain
  round is run whenever this batch size has no measurement of it younger than PROBE_EVERY rounds (under the same
  ledger; a measured cost prior stands in for the first PROBE_EVERY rounds). A prior that is wrong in shape (the
  neutral one: a server without JETFLOW_COST_PRIOR) would otherwise make plain decoding look as expensive as the
  trees it was scaled to, and speculation would never stop.
- Likewise the next smaller tree: its tau is known from the paired gains, but while a larger tree runs, its cost comes
  only from the prior rescaled to the larger tree's. One round at it is run (under the ledger) whenever its bucket has
  no measurement younger than PROBE_EVERY rounds, so a prior wrong in shape cannot keep auto on too large a tree.
- And the next larger tree, when its cost is STALE_COST rounds old and it would win at the best budget's round cost:
  its cost may be what a slow spell left. A measurement after PROBE_EVERY rounds without one replaces a higher
  estimate outright (load only adds time).
"""
from __future__ import annotations

import math
from collections import deque

from jetflow_sglang.core.tree import MAX_BUDGET, check_budget

LADDER = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
FIRST_CAP = 16  # the first choice never exceeds this (and never the largest rung)
PRIOR_SLOPE = 0.35  # tau prior before any tree is verified: 1 + PRIOR_SLOPE * log2(b)
WARMUP = 2  # rounds at the first choice before deciding
GAIN_SD_FLOOR = 0.3  # a gain's spread is not known from one or two rounds
EXPLORE_FRAC = 0.03  # exploration may cost at most this share of the time (regret ledger, see _can_afford)
UCB_C = 1.0  # width of the confidence bound on tau, in standard deviations at log(rounds) = 1
NEUTRAL_PRIOR = {1: 1.0, 64: 2.0, 256: 5.0}  # relative verify cost when nothing is measured
PROBE_EVERY = 64  # rounds after which the plain step's measured cost counts as stale and is measured again
EMA = 0.2  # weight of a new round in a measured cost
SPIKE = 1.25  # a round counts as at most this many times the current estimate (see _learn)
WARM_SAMPLES = 3  # a cost's first measurements: the fastest counts, and it is measured again soon (see _learn)
BURST = 3.0  # a probe taken during a burst of load elsewhere may have run this many times slower (see _plain_stale)
STALE_COST = 2 * PROBE_EVERY  # rounds after which a larger tree's cost may be a slow spell's (_stale_above)


def _bucket(n_tokens: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n_tokens))))


def interp_cost(table: dict[int, float], n: float) -> float:
    """Cost of verifying n tokens from {n: seconds}: log-linear between points, linear beyond the largest."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            w = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return table[lo] * (1 - w) + table[hi] * w
    hi = xs[-1]
    if len(xs) == 1:  # one point: the neutral shape, scaled to it
        return table[hi] * interp_cost(NEUTRAL_PRIOR, n) / interp_cost(NEUTRAL_PRIOR, hi)
    lo = xs[-2]
    slope = max(0.0, (table[hi] - table[lo]) / (hi - lo))
    return table[hi] + slope * (n - hi)


class _Decayed:
    """Exponentially decayed mean and variance (decayed once per round), and the raw count of rounds seen."""
    __slots__ = ("w", "s", "s2", "n")

    def __init__(self):
        self.w = self.s = self.s2 = 0.0
        self.n = 0

    def add(self, xs: list[float], decay: float) -> None:
        self.w = decay * self.w + len(xs)
        self.s = decay * self.s + sum(xs)
        self.s2 = decay * self.s2 + sum(x * x for x in xs)
        self.n += 1

    @property
    def mean(self) -> float:
        return self.s / self.w

    @property
    def std(self) -> float:
        return math.sqrt(max(0.0, self.s2 / self.w - self.mean ** 2))


class AdaptiveBudget:
    """choose(batch) -> tree size for the next round; observe(...) after it. The engine's cost prior comes from
    engine/profiling.py, the server's from JETFLOW_COST_PRIOR (or the neutral prior)."""

    def __init__(self, max_budget: int = 256, *, min_budget: int = 1, cost_prior: dict[int, float] | None = None,
                 draft_prior_s: float | None = None, allow_zero: bool = False, decay: float = 0.95,
                 hysteresis: float = 0.05):
        check_budget(max_budget)
        check_budget(min_budget)
        if min_budget > max_budget:
            raise ValueError(f"min_budget {min_budget} > max_budget {max_budget}")
        if cost_prior is not None and (not cost_prior or any(int(k) < 1 or v <= 0 for k, v in cost_prior.items())):
            raise ValueError(f"cost_prior must map token counts >= 1 to positive seconds; got {cost_prior!r}")
        self.ladder = ([0] if allow_zero else []) + [b for b in LADDER if min_budget <= b <= max_budget]
        if max_budget not in self.ladder:
            self.ladder.append(max_budget)
        self.prior = {int(k): float(v) for k, v in (cost_prior or NEUTRAL_PRIOR).items()}
        self.prior_measured = cost_prior is not None  # a measured prior prices the plain step until it goes stale
        self.draft_prior = draft_prior_s if draft_prior_s is not None else 0.25 * interp_cost(self.prior, 1)
        self.decay, self.hysteresis = decay, hysteresis
        # per rung b >= 2: tokens a budget-b tree accepts beyond the rung below it, per request and round (paired)
        self.inc = {b: _Decayed() for b in self.ladder if b >= 2}
        # (bucket of batch, bucket of verified tokens) -> decayed mean seconds of a tree round's verify: the same
        # tokens cost more spread over more requests, so costs measured at one batch size do not price another
        self.verify_s: dict[tuple[int, int], float] = {}
        self.plain_s: dict[int, float] = {}  # bucket of batch -> seconds of a plain decode step (budget 0)
        self.plain_at: dict[int, int] = {}  # bucket of batch -> round of the lowest rung's last measurement
        self.verify_at: dict[tuple[int, int], int] = {}  # the same keys -> round of its last measurement
        self.draft_s: dict[tuple[int, int], float] = {}  # (rung, bucket of batch) -> decayed mean seconds of a draft
        self.samples: dict[tuple[str, object], int] = {}  # (table name, key) -> measurements taken
        self._learnt_at: dict[tuple[str, object], int] = {}  # (table name, key) -> round of its last measurement
        self.t = 0  # rounds observed
        self.tree_at = 0  # the last round that verified a tree of 2 or more nodes
        self.current: int | None = None
        self.explored = 0  # rounds spent on exploration (for tests and reports)
        self.elapsed = 0.0  # seconds of all observed rounds
        self.regret = 0.0  # seconds exploration rounds took beyond what the best budget would have needed
        # one entry per choose() not yet observed, oldest first: (explored budget, best rate when it was chosen), or
        # None for a round that did not explore. Feedback may arrive rounds late (the SGLang worker reads it back
        # without waiting for the device), so each observation settles the choice it was made under.
        self._pending: deque[tuple[int, float] | None] = deque(maxlen=16)
        self._exploring: tuple[int, float] | None = None

    # ---- estimates ----------------------------------------------------------------------------------------------
    def tau(self, b: int) -> float | None:
        """Accepted tokens per round at budget b: 1 + the paired gains of every rung up to b."""
        if b <= 1:
            return 1.0
        rung = self._rung(b)
        if self.inc[rung].n == 0:
            return None
        return 1.0 + sum(a.mean for r, a in self.inc.items() if r <= rung)

    def _rung(self, b: int) -> int:
        return max([r for r in self.ladder if r <= b], default=self.ladder[0])

    def cost(self, n_tokens: int, batch: int = 1) -> float:
        """Seconds of one verify forward over n_tokens for `batch` requests: the buckets measured at this batch size
        (or the nearest one measured), the prior (rescaled to them) elsewhere."""
        measured = self._measured(batch)
        bucket = _bucket(n_tokens)
        if bucket in measured:
            return measured[bucket]
        table = {k: v * self._prior_scale(measured) for k, v in self.prior.items()}
        table.update(measured)
        return interp_cost(table, n_tokens)

    def _near(self, batch: int) -> int | None:
        """The batch-size bucket measured nearest to batch's."""
        sizes = {k[0] for k in self.verify_s}
        return min(sizes, key=lambda s: (abs(math.log2(s) - math.log2(_bucket(batch))), s)) if sizes else None

    def _measured(self, batch: int) -> dict[int, float]:
        """Verify seconds per bucket of tokens measured at batch's size bucket, or at the nearest one measured."""
        near = self._near(batch)
        return {tokens: v for (s, tokens), v in self.verify_s.items() if s == near}

    def _prior_scale(self, measured: dict[int, float]) -> float:
        if not measured:
            return 1.0
        ratios = [v / interp_cost(self.prior, k) for k, v in measured.items()]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    def draft_cost(self, b: int, batch: int = 1) -> float:
        """Seconds of drafting a budget-b round for `batch` requests: measured per rung and batch size (one head
        forward drafts the whole batch, so its cost grows with the batch: a cost learnt at batch 8 must not price
        batch 1); unmeasured, the nearest measured batch size, then the nearest rung."""
        if b == 0:
            return 0.0
        key = (self._rung(b), _bucket(batch))
        if key in self.draft_s:
            return self.draft_s[key]
        if b == 1:  # no head forward; the head may still advance its context
            return 0.5 * self.draft_prior
        known = [k for k in self.draft_s if k[0] >= 2]
        dist = lambda k: (abs(math.log2(k[1] / key[1])), abs(math.log2(k[0] / key[0])))  # noqa: E731
        return self.draft_s[min(known, key=dist)] if known else self.draft_prior

    def cost_lower(self, n_tokens: int, batch: int = 1) -> float:
        """An optimistic verify cost: a tree is never cheaper to verify than a smaller measured one, and may cost no
        more (a wrong prior, e.g. profiled on a busy machine, must not hide a cheap budget forever)."""
        measured = self._measured(batch)
        below = [k for k in measured if k <= _bucket(n_tokens)]
        return measured[max(below)] if below else self.cost(n_tokens, batch)

    def _stale_above(self, best: int, batch: int) -> int | None:
        """The next larger tree when its cost was last measured STALE_COST rounds ago or more and, priced at no more
        than the best budget's round, it would beat the best: that cost may be what a slow spell left (a server
        that sat through load on trees of 8 nodes kept their cost 1.5x too high and decoded the rest of a run at 2:
        bench/results/sglang_budget_sweep.md, MATH-500 at concurrency 1). One round measures it again, and _learn
        takes the new cost if it is lower."""
        above = self._next_rung(best)
        if best < 2 or above is None or self.tau(above) is None:
            return None
        if not self._stale(self.verify_at.get((self._near(batch), _bucket(batch * above))), True, STALE_COST):
            return None
        optimistic = batch * self.tau(above) / (self.draft_cost(above, batch) + self.cost(batch * best, batch))
        return above if optimistic > (1 + self.hysteresis) * self.rate(best, batch) else None

    def round_cost(self, b: int, batch: int, optimistic: bool = False) -> float:
        if b == 0:
            return self.plain_s.get(_bucket(batch)) or self.cost(batch, batch)
        return self.draft_cost(b, batch) + (self.cost_lower if optimistic else self.cost)(batch * b, batch)

    def _largest_observed(self) -> int | None:
        seen = [b for b, a in self.inc.items() if a.n > 0]
        return max(seen) if seen else None

    def tau_optimistic(self, b: int) -> float:
        """An upper confidence bound on tau(b). Gains are paired (each tree measures a rung and the one below it on
        the same round), so they are far less noisy than tau itself; an unseen rung gains at most what the last one
        did (diminishing returns), plus the same confidence width."""
        if b <= 1:
            return 1.0
        logt = math.log(2 + self.t)
        rung, top = self._rung(b), self._largest_observed()
        if top is None:
            return 1 + PRIOR_SLOPE * math.log2(b) + UCB_C * math.sqrt(logt)
        # plain rounds teach nothing about trees: each one ages what the trees taught (discounted UCB), so an
        # unlucky start that sent auto to plain decoding is tried again after a few rounds, not after hundreds
        age = self.decay ** (self.t - self.tree_at)
        width = lambda a: UCB_C * max(a.std, GAIN_SD_FLOOR) * math.sqrt(logt / max(1e-3, a.n * age))  # noqa: E731
        if rung <= top:
            return self.tau(rung) + width(self.inc[rung])
        a = self.inc[top]
        steps = sum(1 for r in self.inc if top < r <= rung)
        return self.tau(top) + steps * (a.mean + width(a))

    def rate(self, b: int, batch: int = 1, optimistic: bool = False) -> float | None:
        tau = self.tau_optimistic(b) if optimistic else self.tau(b)
        return None if tau is None else batch * tau / self.round_cost(b, batch, optimistic)

    # ---- decisions ----------------------------------------------------------------------------------------------
    def choose(self, batch: int = 1) -> int:
        self._exploring = None
        out = self._choose(batch)
        self._pending.append(self._exploring)
        return out

    def _choose(self, batch: int) -> int:
        if self.current is None:
            self.current = self._first_choice(batch)
        if self.t < WARMUP:  # a few rounds at the first choice measure tau for every budget up to it at once
            return self.current
        known = [b for b in self.ladder if self.tau(b) is not None]
        best = max(known, key=lambda b: self.rate(b, batch))
        cur = self.current if self.current in known else best
        low = self.ladder[0]
        if self.rate(cur, batch) >= (1 - self.hysteresis) * self.rate(best, batch) and (cur == low or best != low):
            best = cur  # hysteresis: stay unless another budget is clearly better; plain decoding wins every tie
        self.current = best
        if best != low and self._plain_stale(batch, best) and self._can_afford(low, best, batch):
            return self._explore(low, best, batch)  # measure the plain step instead of trusting its extrapolated cost
        below = self._prev_rung(best)  # its tau is known (paired gains), its cost only from the prior
        if below is not None and below >= 2 and self._tree_stale(below, batch) and self._can_afford(below, best, batch):
            return self._explore(below, best, batch)
        above = self._stale_above(best, batch)
        if above is not None and self._can_afford(above, best, batch):
            return self._explore(above, best, batch)
        bar = (1 + self.hysteresis) * self.rate(best, batch)
        top = self._largest_observed()
        # only larger trees teach something new; never more than one doubling past what has been seen (before any
        # tree was seen: up to FIRST_CAP, one tree then measures every smaller budget)
        reach = (self._next_rung(top) or top) if top is not None else FIRST_CAP
        bigger = [b for b in self.ladder if max(best, 1) < b <= reach]
        if bigger:
            cand = max(bigger, key=lambda b: self.rate(b, batch, optimistic=True))
            if self.rate(cand, batch, optimistic=True) > bar and self._can_afford(cand, best, batch):
                return self._explore(cand, best, batch)
        return best

    def _explore(self, cand: int, best: int, batch: int) -> int:
        """Run one round at cand instead of best; observe() books what it cost against best (the regret ledger)."""
        self.explored += 1
        self._exploring = (cand, self.rate(best, batch))
        return cand

    def _can_afford(self, cand: int, best: int, batch: int) -> bool:
        """Exploration may lose at most EXPLORE_FRAC of the time so far (plus one round) against the best budget."""
        worst = self.round_cost(cand, batch) - batch / self.rate(best, batch)  # the round if it accepts nothing extra
        allowance = EXPLORE_FRAC * self.elapsed + self.round_cost(best, batch)
        return self.regret + max(0.0, worst) <= allowance

    def _stale(self, seen: int | None, unseen: bool, horizon: int = PROBE_EVERY) -> bool:
        """A measurement taken at round `seen` is older than `horizon` rounds; `unseen` when there is none."""
        return unseen if seen is None else self.t - seen >= horizon

    def _plain_stale(self, batch: int, best: int) -> bool:
        """A measured prior stands in for the first PROBE_EVERY rounds. While fewer than WARM_SAMPLES plain rounds
        were measured, one may have hit a burst of load: they are repeated after PROBE_EVERY // 16 rounds if plain
        decoding would beat the best tree at BURST times less cost (a tree kept on a wrong plain cost can lose to plain
        decoding; a wrong tree cost only picks a tree that is slower than another)."""
        key, low = _bucket(batch), self.ladder[0]
        seen = self.plain_at.get(key)
        if seen is None:
            return not self.prior_measured or self.t >= PROBE_EVERY
        measured = self.samples.get(("plain_s", key) if low == 0 else ("verify_s", (key, key)), 0)  # see observe
        doubtful = measured < WARM_SAMPLES and batch * BURST / self.round_cost(low, batch) > self.rate(best, batch)
        return self._stale(seen, False, PROBE_EVERY // 16 if doubtful else PROBE_EVERY)

    def _tree_stale(self, b: int, batch: int) -> bool:
        return self._stale(self.verify_at.get((_bucket(batch), _bucket(batch * b))), True)

    def _prev_rung(self, b: int) -> int | None:
        return max([r for r in self.ladder if r < b], default=None)

    def _next_rung(self, b: int) -> int | None:
        return min([r for r in self.ladder if r > b], default=None)

    def _first_choice(self, batch: int) -> int:
        cands = [b for b in self.ladder if b <= FIRST_CAP and (b < self.ladder[-1] or len(self.ladder) == 1)]
        prior_tau = lambda b: 1.0 if b <= 1 else 1 + PRIOR_SLOPE * math.log2(b)  # noqa: E731
        return max(cands or self.ladder[:1], key=lambda b: batch * prior_tau(b) / self.round_cost(b, batch))

    def snapshot(self, batch: int = 1) -> dict:
        """What the controller believes now (the SGLang worker exports it in /server_info): the budget it is on, and
        per budget its estimated tau, round seconds and rate at `batch` (None where tau is not known yet), plus the
        exploration ledger. Budgets are strings (JSON keys)."""
        rows = {}
        for b in self.ladder:
            tau = self.tau(b)
            rows[str(b)] = {"tau": None if tau is None else round(tau, 4),
                            "round_s": round(self.round_cost(b, batch), 6),
                            "tokens_per_s": None if tau is None else round(self.rate(b, batch), 3)}
        return {"current": self.current, "rounds": self.t, "explored": self.explored, "batch": batch,
                "regret_s": round(self.regret, 4), "elapsed_s": round(self.elapsed, 4), "budgets": rows}

    # ---- feedback -----------------------------------------------------------------------------------------------
    def observe(self, path, budget: int, batch: int = 1, verify_s: float = 0.0, draft_s: float = 0.0) -> None:
        """path: accepted node ids of one request, root first; budget: its tree size (0: a plain decode step)."""
        self._observe_paths([_ids(path)], budget, batch, verify_s, draft_s)

    def observe_batch(self, accept_index, budget: int, verify_s: float, draft_s: float = 0.0) -> None:
        """accept_index: [b, Dmax+1] accepted node ids per request, -1 padded (tensor or nested lists)."""
        rows = accept_index.tolist() if hasattr(accept_index, "tolist") else accept_index
        rows = [_ids(r) for r in rows]
        if rows:
            self._observe_paths(rows, budget, len(rows), verify_s, draft_s)

    def _observe_paths(self, paths: list[list[int]], budget: int, batch: int, verify_s: float, draft_s: float) -> None:
        self.t += 1
        budget, batch = int(budget), max(1, int(batch))
        round_s = max(0.0, verify_s) + max(0.0, draft_s)
        self.elapsed += round_s
        settled = self._pending.popleft() if self._pending else None
        if settled is not None:
            cand, best_rate = settled
            if cand == budget and best_rate > 0 and round_s > 0:  # time lost (or won) against the best budget
                tokens = sum(1 + sum(1 for i in p[1:] if i < budget) for p in paths)
                self.regret += round_s - tokens / best_rate
        prev = [1] * len(paths)  # rung 1 (or 0) accepts the bonus token only
        for b, gain in self.inc.items():
            if b > budget:
                break
            # nodes < b on a prefix-closed path form its prefix, so they are what the budget-b tree would accept
            now = [1 + sum(1 for i in path[1:] if i < b) for path in paths]
            gain.add([x - y for x, y in zip(now, prev)], self.decay)
            prev = now
        if budget >= 2:
            self.tree_at = self.t
        bb = _bucket(batch)
        if budget <= self.ladder[0]:
            self.plain_at[bb] = self.t
        if verify_s > 0:
            name, key = ("plain_s", bb) if budget == 0 else ("verify_s", (bb, _bucket(batch * budget)))
            self._learn(name, key, verify_s)
            if budget >= 1:
                self.verify_at[key] = self.t
        if budget >= 1 and draft_s >= 0:
            self._learn("draft_s", (self._rung(budget), _bucket(batch)), draft_s)

    def _learn(self, name: str, key, seconds: float) -> None:
        """Book one measured cost in table `name` (plain_s, verify_s or draft_s). Load elsewhere only adds time, so
        - the first WARM_SAMPLES measurements of a key keep their minimum: a burst during a first probe does not
          stand for the cost until the next probe (one 3x plain probe kept trees that ran at 0.6x plain decoding);
        - after them, an exponential mean in which a round counts as at most SPIKE times the current estimate. One
          slow round (another process on a shared CPU, a GC pause) then moves the estimate by at most 5%, where it
          could make the best budget look 40% dearer and be abandoned, its inflated cost never measured again while
          another budget runs. A real rise is still learnt, 5% a round; a fall moves it by EMA of the difference,
        - except the first measurement after PROBE_EVERY rounds without one: if the machine now runs it faster, that
          is its cost (load only adds time). A cost learnt during a slow spell and left since would otherwise need
          a dozen probes to unlearn, and keep auto off the budget meanwhile."""
        table, n = getattr(self, name), self.samples.get((name, key), 0)
        self.samples[(name, key)] = n + 1
        old, seen = table.get(key), self._learnt_at.get((name, key))
        self._learnt_at[(name, key)] = self.t
        if old is not None and seconds < old and seen is not None and self.t - seen >= PROBE_EVERY:
            table[key] = seconds  # a stale cost that the machine now beats: the spell it was learnt in is over
        elif old is None or n < WARM_SAMPLES:
            table[key] = seconds if old is None else min(old, seconds)
        else:
            table[key] = (1 - EMA) * old + EMA * min(seconds, SPIKE * old)


def _ids(path) -> list[int]:
    path = path.tolist() if hasattr(path, "tolist") else path
    return [int(i) for i in path if int(i) >= 0]


def parse_budget(value) -> int | str:
    """An int in [1, 512] or 'auto'."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return check_budget(int(value))
    except (TypeError, ValueError):
        raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto'; got {value!r}") from None


__all__ = ["AdaptiveBudget", "LADDER", "MAX_BUDGET", "interp_cost", "parse_budget"]
