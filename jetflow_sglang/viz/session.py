"""Per-browser-tab state of the explorer.

Gradio creates one `Session` per tab (gr.State(lambda: Session()) calls the factory for each new tab) and hands
every event of that tab the same object, so two tabs never share rounds, text or the stop flag. It holds plain
data only: trees are kept without their draft distributions, the target's view as lists.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from jetflow_sglang.core.tree import DraftTree

from .target_view import TargetView

TAU_DEF = "τ = tokens committed per verify step (accepted draft tokens + the target's own token)"


@dataclass
class RoundView:
    tree: DraftTree
    path: list[int]
    new_tokens: list[int]
    drafted_text: str    # what the round's accepted draft tokens add to the decoded text
    bonus_text: str      # what the rest (the target's own bonus token) adds
    n_drafted: int       # how many of new_tokens are accepted draft tokens
    draft_s: float
    verify_s: float
    target: TargetView | None = None
    start: int = 0       # output position of the round's first new token (aligns rounds of two runs)

    @property
    def target_token(self) -> int | None:
        """The token the target chose at the first rejection (None when EOS or the token limit cut it)."""
        return self.new_tokens[self.n_drafted] if len(self.new_tokens) > self.n_drafted else None


@dataclass
class Session:
    rounds: list[RoundView] = field(default_factory=list)
    prompt: str = ""
    drafter: str = ""
    budget: int = 0
    settings: dict = field(default_factory=dict)  # every setting of the run, shown and exported
    stop_requested: bool = False  # set by the Stop button's handler, read by the generator between rounds
    running: bool = False         # a Live-tab generation is under way
    sweeping: bool = False        # a budget sweep is under way
    running_ar: bool = False      # plain decoding of the same prompt is being timed
    message: str = ""
    compute_s: float = 0.0        # time spent inside the engine (prefill included, page updates excluded)
    ar_tokens_per_s: float | None = None  # plain decoding of the same prompt and settings, when measured
    ar_identical: bool | None = None
    labels: dict[int, str] = field(default_factory=dict)  # token id -> text, for every token a plot shows
    _decoded: str = ""
    _first: str = ""  # text of the prefill token
    _tokens: list[int] = field(default_factory=list)

    def reset(self, prompt: str, drafter: str, budget: int, settings: dict | None = None) -> None:
        self.rounds, self._tokens, self._decoded, self._first = [], [], "", ""
        self.prompt, self.drafter, self.budget = prompt, drafter, budget
        self.settings = dict(settings or {}, drafter=drafter, budget=budget)
        self.stop_requested, self.running, self.message, self.running_ar = False, True, "", False
        self.compute_s, self.ar_tokens_per_s, self.ar_identical = 0.0, None, None

    def add_prefill(self, new_tokens, decode) -> None:
        """The token that comes out of prefill: text only, it has no draft tree."""
        self._tokens += [int(t) for t in new_tokens]
        self._decoded = self._first = decode(self._tokens)

    def add_round(self, tree: DraftTree, path, new_tokens, draft_s: float, verify_s: float, decode,
                  target: TargetView | None = None, decode_one=None) -> RoundView:
        """Record one engine Round. `decode(ids) -> str` decodes the whole output so far, so multi-token
        characters are split correctly; the round's text is what its tokens add to that string.
        `decode_one(id)` names single tokens for the plots (kept in `labels`, so an exported run needs no tokenizer)."""
        light = DraftTree(list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.logps))
        path, new_tokens = [int(i) for i in path], [int(t) for t in new_tokens]
        # the accepted nodes after the root are draft tokens; what the round commits beyond them came from the target
        n_drafted = max(0, min(len(path) - 1, len(new_tokens)))
        mid = decode(self._tokens + new_tokens[:n_drafted]) if n_drafted else self._decoded
        start = len(self._tokens)
        self._tokens += new_tokens
        text = decode(self._tokens)
        # a token that completes a multi-byte character can change the tail of the earlier text: cut by length
        drafted, bonus = mid[len(self._decoded):], text[len(mid):]
        self._decoded = text
        view = RoundView(light, path, new_tokens, drafted, bonus, n_drafted, float(draft_s), float(verify_s),
                         target, start)
        if decode_one is not None:
            ids = set(light.tokens) | set(new_tokens)
            if target is not None:
                ids.update(t for row in target.top_ids for t in row)
            for t in ids - self.labels.keys():
                self.labels[t] = decode_one(t)
        self.rounds.append(view)
        return view

    def label(self, tok: int) -> str:
        return self.labels.get(int(tok), str(tok))

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def text(self) -> str:
        return self._decoded

    @property
    def accept_lengths(self) -> list[int]:
        return [len(r.new_tokens) for r in self.rounds]

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (accepted drafts + bonus): the paper's acceptance length.
        The prefill token is not a round, as in engine.Result.tau."""
        return sum(self.accept_lengths) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        busy = sum(r.draft_s + r.verify_s for r in self.rounds)
        return sum(self.accept_lengths) / busy if busy > 0 else 0.0  # decode speed: the prefill is not timed

    @property
    def wall_tokens_per_s(self) -> float:
        """All tokens over the engine's time, prefill included: measured like plain decoding's tokens/s."""
        return self.n_tokens / self.compute_s if self.compute_s > 0 else 0.0

    @property
    def speedup(self) -> float | None:
        if not self.ar_tokens_per_s or not self.compute_s:
            return None
        return self.wall_tokens_per_s / self.ar_tokens_per_s

    def settings_text(self) -> str:
        s = self.settings
        eos = s.get("eos")
        parts = [f"drafter `{self.drafter}`", f"budget {self.budget}"]
        for key, name in (("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p"),
                          ("max_tokens", "max tokens"), ("width", "width"), ("dtype", "dtype"), ("seed", "seed")):
            if key in s:
                parts.append(f"{name} {s[key]}")
        if eos is not None:
            parts.append("stops at end-of-text" if eos else "ignores end-of-text")
        return " · ".join(parts)

    def stats_markdown(self) -> str:
        if not self.rounds:
            return "no rounds yet"
        draft = sum(r.draft_s for r in self.rounds)
        verify = sum(r.verify_s for r in self.rounds)
        state = "running" if self.running else ("stopped" if self.stop_requested else "done")
        if self.speedup is not None:
            same = "" if self.ar_identical is None else f", identical text: {self.ar_identical}"
            speed = (f"**speedup {self.speedup:.2f}x** over plain decoding of the same prompt "
                     f"({self.wall_tokens_per_s:.1f} vs {self.ar_tokens_per_s:.1f} tok/s, prefill included{same})")
        elif self.running_ar:
            speed = "measuring plain decoding of the same prompt for the speedup…"
        elif self.running:
            speed = "speedup over plain decoding: measured after the run"
        else:
            speed = "speedup over plain decoding: not measured"
        return (f"{state} · {self.settings_text()} · rounds {len(self.rounds)} · "
                f"tokens {self.n_tokens} · **tau {self.tau:.2f}** · **{self.tokens_per_s:.1f} tok/s** "
                f"(draft {draft:.2f}s, verify {verify:.2f}s) · {speed}  \n{TAU_DEF}")

    def text_html(self, upto: int | None = None) -> str:
        """The generated text: each round is a span (alternating backgrounds), its accepted draft tokens
        underlined and the target's bonus token plain; hovering names the round. `upto` marks the scrubbed round."""
        parts = [f'<span class="jf-first" title="first token, from prefill">{html.escape(self._first)}</span>']
        for k, r in enumerate(self.rounds, 1):
            cls = f"jf-r{k % 2}" + (" jf-cur" if k == upto else "")
            tip = f"round {k}: {r.n_drafted} accepted draft token(s) + {len(r.new_tokens) - r.n_drafted} from the target"
            parts.append(f'<span class="{cls}" title="{html.escape(tip)}" data-round="{k}">'
                         f'<span class="jf-acc">{html.escape(r.drafted_text)}</span>{html.escape(r.bonus_text)}</span>')
        return '<div class="jf-text">' + "".join(parts) + "</div>"
