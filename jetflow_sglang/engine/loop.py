"""The speculative loop: draft a tree, verify it in one target forward, keep the accepted path, repeat."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from jetflow_sglang.engine.batch_target import BatchTarget
from jetflow_sglang.core.budget import parse_budget
from jetflow_sglang.engine.profiling import auto_budget
from jetflow_sglang.engine.target import Target
from jetflow_sglang.draft.context_kv import ContextKV
from jetflow_sglang.draft.drafters import WithLookup
from jetflow_sglang.core.tree import DraftTree
from jetflow_sglang.core.tree_batch import TreeBatch
from jetflow_sglang.core.verify import check_sampling, greedy_accept, greedy_accept_batch, process_logits, sample_accept


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
def generate_batch(target: Target, drafter, prompts, max_new_tokens: int = 128, budget: int = 16, eos_ids=(),
                   temperature: float = 0.0) -> list[Result]:
    """Greedy speculative decoding of several prompts together: per round one head forward (two for jetflow-branch)
    and one target verify forward for the whole batch, ragged trees padded to `budget` slots. Finished requests leave
    the batch. Token-identical to per-prompt `run` (and to `autoregressive`) up to floating-point near-ties."""
    if temperature != 0:
        raise ValueError("generate_batch decodes greedily (temperature 0); use generate for sampling")
    budget = parse_budget(budget)
    if budget == "auto":
        raise ValueError("generate_batch takes a fixed budget (1-512)")
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts")
    for p in prompts:
        _check(target, p, max_new_tokens, 0.0, 0, 1.0)
    eos = set(eos_ids)
    limits = [min(max_new_tokens, target.max_length - len(p)) for p in prompts]
    results = [Result(p, []) for p in prompts]
    t_start = time.perf_counter()
    bt = BatchTarget(target)
    last, taps = bt.prefill(prompts)
    anchors = last.argmax(-1).tolist()
    lookup, drafter = (drafter, drafter.base) if isinstance(drafter, WithLookup) else (None, drafter)
    if lookup is not None:  # every request's committed tokens before its anchor, for the lookup tries
        history = torch.zeros(len(prompts), max(map(len, prompts)) + max_new_tokens + 1, dtype=torch.long,
                              device=target.device)
        for i, p in enumerate(prompts):
            history[i, :len(p)] = torch.tensor(p)
        hist_lens = [len(p) for p in prompts]
    batched = hasattr(drafter, "draft_batch")
    if batched:
        ctx = ContextKV(_padded_kv(drafter, taps), [len(p) for p in prompts])
    states = None if batched else [drafter.new_state(p, t) for p, t in zip(prompts, taps)]
    for res, a in zip(results, anchors):
        res.rounds.append(Round(None, [], [a]))
        res.tokens.append(a)
    active = [i for i in range(len(prompts)) if len(results[i].tokens) < limits[i] and anchors[i] not in eos]
    _keep(bt, ctx if batched else None, list(range(len(prompts))), active)
    while active:
        t0 = time.perf_counter()
        size = max(1, min([budget] + [target.max_length - n for n in bt.lens]))
        anchor_t = torch.tensor([anchors[i] for i in active], device=target.device)
        if batched:
            tb = drafter.draft_batch(anchor_t, ctx.views(), ctx.lens_tensor(), size)
        else:
            tb = TreeBatch.from_trees([drafter.draft(states[i], anchors[i], size) for i in active], size,
                                      target.device)
        if lookup is not None:
            rows = torch.tensor(active, device=target.device)
            tb = lookup.merge_batch(tb, history[rows], torch.tensor([hist_lens[i] for i in active]), size)
        t1 = time.perf_counter()
        logits, new_taps = bt.verify(tb)
        index, length, bonus = greedy_accept_batch(tb, logits.argmax(-1))
        lengths = length.tolist()
        bt.commit(index, lengths)
        index_l, bonus_l, trees = index.tolist(), bonus.tolist(), tb.trees()
        t2 = time.perf_counter()
        if batched:
            rows = new_taps.gather(1, index.clamp(min=0)[..., None].expand(-1, -1, new_taps.shape[-1]))
            ctx.append(drafter.context_kv(rows, ctx.lens_tensor()), lengths)
        still = []
        for r, i in enumerate(active):
            path = index_l[r][:lengths[r]]
            tree = trees[r]
            if not batched:
                drafter.advance(states[i], [tree.tokens[p] for p in path], None)
            new = [tree.tokens[p] for p in path[1:]] + [bonus_l[r]]
            stop = next((k + 1 for k, t in enumerate(new) if t in eos), len(new))
            new = new[: min(stop, limits[i] - len(results[i].tokens))]
            results[i].tokens.extend(new)
            if lookup is not None:  # the old anchor and all new tokens but the last are committed now
                history[i, hist_lens[i]:hist_lens[i] + len(new)] = torch.tensor([anchors[i]] + new[:-1])
                hist_lens[i] += len(new)
            anchors[i] = new[-1]
            if len(results[i].tokens) < limits[i] and new[-1] not in eos:
                still.append(i)
            results[i].rounds.append(Round(tree, path, new, 0.0, t2 - t1))
        draft_s = (t1 - t0) + (time.perf_counter() - t2)
        for i in active:
            results[i].rounds[-1].draft_s = draft_s
        _keep(bt, ctx if batched else None, active, still)
        active = still
    for res in results:
        res.elapsed_s = time.perf_counter() - t_start
    return results


def _padded_kv(drafter, taps: list[torch.Tensor]):
    """Head context K/V of ragged prompts, right-padded into one batch."""
    width = max(t.shape[0] for t in taps)
    padded = torch.stack([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[0])) for t in taps])
    return drafter.context_kv(padded, torch.zeros(len(taps), dtype=torch.long))


def _keep(bt: BatchTarget, ctx: ContextKV | None, before: list[int], after: list[int]) -> None:
    if after == before:
        return
    rows = [before.index(i) for i in after]
    if after:
        bt.keep(rows)
        if ctx is not None:
            ctx.keep(rows)


@torch.no_grad()
def autoregressive(target: Target, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, eos_ids=(), seed: int = 0) -> Result:
    """Plain decoding, one token per forward: the reference for losslessness and speed. The HF model with its own
    causal masking, or with exact rows (exact.py) the target's one-node verify, which rounds as verify rows do."""
    _check(target, prompt_ids, max_new_tokens, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(seed)
    eos = set(eos_ids)
    max_new_tokens = min(max_new_tokens, target.max_length - len(prompt_ids))
    cache = DynamicCache(config=target.config)
    out: list[int] = []
    t0 = time.perf_counter()
    if target.exact:
        logits = target.prefill(list(prompt_ids))[0][-1]
    else:
        ids = torch.tensor([list(prompt_ids)], device=target.device)
        logits = target.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    while True:
        out.append(_pick(logits.float(), temperature, top_k, top_p, gen))
        if out[-1] in eos or len(out) >= max_new_tokens:
            break
        if target.exact:
            logits = target.verify(DraftTree.root(out[-1]))[0][0]
            target.commit([0])
        else:
            ids = torch.tensor([[out[-1]]], device=target.device)
            logits = target.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return Result(list(prompt_ids), out, elapsed_s=time.perf_counter() - t0)
