"""The speculative loop: draft a tree, verify it in one target forward, keep the accepted path, repeat."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from .budget import auto_budget, parse_budget
from .target import Target
from .tree import DraftTree
from .verify import check_sampling, greedy_accept, process_logits, sample_accept


@dataclass
class Round:
    tree: DraftTree | None  # None for the token that comes out of prefill
    path: list[int]
    new_tokens: list[int]
    draft_s: float = 0.0  # drafting this round's tree + advancing the head over its accepted tokens
    verify_s: float = 0.0  # target forward, acceptance and KV compaction
    # the target's top-k token ids and probabilities at every verified node (generate(..., target_topk=k > 0) only)
    target_top: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Result:
    prompt_ids: list[int]
    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def steps(self) -> int:
        return sum(1 for r in self.rounds if r.tree is not None)

    @property
    def tau(self) -> float:
        """Tokens per verify step (the prefill token is not a verify step)."""
        spec = [r for r in self.rounds if r.tree is not None]
        return sum(len(r.new_tokens) for r in spec) / max(1, len(spec))

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(process_logits(logits.cpu(), temperature, top_k, top_p), 1, generator=gen))


def _check(target: Target, prompt_ids, max_new_tokens: int, temperature, top_k, top_p) -> None:
    target.check_prompt(prompt_ids)
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")


def generate(target: Target, drafter, prompt_ids, max_new_tokens: int = 128, budget: int | str = 16,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, eos_ids=(), seed: int = 0,
             max_budget: int = 256, target_topk: int = 0) -> Iterator[Round]:
    """budget: tree nodes per verify step (1-512, root included), or "auto" to learn the fastest one online.

    Budget 1 is plain decoding: head drafters run no head forward, but still advance their context each round.
    Round.draft_s counts the draft and the head's advance over the round's accepted tokens (both are drafting cost).
    target_topk > 0 fills Round.target_top (for the explorer)."""
    if not isinstance(target_topk, int) or target_topk < 0:
        raise ValueError(f"target_topk must be an integer >= 0; got {target_topk!r}")
    budget = parse_budget(budget)
    auto = auto_budget(target, max_budget) if budget == "auto" else None  # prior: verify cost measured once per machine
    _check(target, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(seed)
    eos = set(eos_ids)
    max_new_tokens = min(max_new_tokens, target.max_length - len(prompt_ids))

    logits, taps = target.prefill(list(prompt_ids))
    anchor = _pick(logits[-1], temperature, top_k, top_p, gen)
    state = drafter.new_state(list(prompt_ids), taps)
    done = 1
    yield Round(None, [], [anchor])
    while done < max_new_tokens and anchor not in eos:
        t0 = time.perf_counter()
        room = target.max_length - target.length  # the tree must fit in the context
        size = auto.choose() if auto else budget
        tree = drafter.draft(state, anchor, max(1, min(size, room)), temperature, gen)
        t1 = time.perf_counter()
        logits, taps = target.verify(tree)
        top = _target_top(logits, target_topk) if target_topk > 0 else None
        if temperature == 0:
            path, bonus = greedy_accept(tree, logits.argmax(-1).tolist())
        else:
            path, bonus = sample_accept(tree, process_logits(logits, temperature, top_k, top_p), gen)
        target.commit(path)
        new = [tree.tokens[i] for i in path[1:]] + [bonus]
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))  # EOS or the limit may fall mid-path
        new = new[: min(stop, max_new_tokens - done)]
        t2 = time.perf_counter()
        drafter.advance(state, [tree.tokens[i] for i in path], taps[path])
        draft_s = (t1 - t0) + (time.perf_counter() - t2)
        done += len(new)
        anchor = new[-1]
        if auto:
            auto.observe(path, len(tree), 1, t2 - t1, draft_s)
        yield Round(tree, path, new, draft_s, t2 - t1, top)


def _target_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ids = logits.float().softmax(-1).topk(min(k, logits.shape[-1]), -1)
    return ids.cpu(), probs.cpu()


def run(target: Target, drafter, prompt_ids, **kw) -> Result:
    res = Result(list(prompt_ids), [])
    t0 = time.perf_counter()
    for rnd in generate(target, drafter, prompt_ids, **kw):
        res.rounds.append(rnd)
        res.tokens.extend(rnd.new_tokens)
    res.elapsed_s = time.perf_counter() - t0
    return res


@torch.no_grad()
def autoregressive(target: Target, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, eos_ids=(), seed: int = 0) -> Result:
    """Plain decoding with the HF model and its own causal masking: the reference for losslessness and speed."""
    _check(target, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(seed)
    eos = set(eos_ids)
    max_new_tokens = min(max_new_tokens, target.max_length - len(prompt_ids))
    cache = DynamicCache(config=target.config)
    ids = torch.tensor([list(prompt_ids)], device=target.device)
    out: list[int] = []
    t0 = time.perf_counter()
    while len(out) < max_new_tokens:
        logits = target.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
        out.append(_pick(logits, temperature, top_k, top_p, gen))
        if out[-1] in eos:
            break
        ids = torch.tensor([[out[-1]]], device=target.device)
    return Result(list(prompt_ids), out, elapsed_s=time.perf_counter() - t0)
