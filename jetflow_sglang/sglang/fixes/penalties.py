"""Frequency, presence, repetition and min-new-tokens penalties applied per tree path (lossless with penalties).

SGLang's speculative path penalises every draft node with the counts SGLang's penalizers hold before the round
("a relaxed version of penalties for speculative decoding"); those are fed only the last token of each round, and
never the first output token. Here node i's logits are penalised with the request's own output tokens (counted from
`req.output_ids`, so nothing is missed) plus the drafted tokens on i's own path (root excluded: it is the last output
token, already counted), and min-new-tokens' stop-token ban is lifted at the depth where the path reaches it.
Semantics as SGLang's penaltylib (outputs only, OpenAI-style frequency/presence, CTRL-style repetition); order as its
speculative path: additive penalties, then the ban, then scaling. Nothing runs when no request uses penalties.

On SGLang's overlap scheduler the host's `req.output_ids` are a round behind, so a decode batch in which a request
uses a history-dependent penalty (or a custom logit processor: logit_chain.py) runs synchronously
(`install_sync_fallback`: SGLang finishes the previous round first, as it does for grammar batches); the penalties
stay exact, and other batches keep overlapping.
"""
from __future__ import annotations

import torch

from jetflow_sglang.sglang.compat import wrap


def path_counts(tokens: torch.Tensor, anc: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b, n, V] float: how often each token occurs on node i's path, the root excluded."""
    b, n = tokens.shape
    onehot = torch.zeros(b, n, vocab, device=tokens.device).scatter_(2, tokens[..., None].clamp(0, vocab - 1), 1.0)
    anc = anc.float().clone()
    anc[:, :, 0] = 0.0
    return torch.bmm(anc, onehot)


def output_counts(reqs, vocab: int, device) -> torch.Tensor:
    """[b, V] float: how often each token occurs in each request's output so far (host bookkeeping)."""
    rows = [i for i, r in enumerate(reqs) for _ in r.output_ids]
    cols = [int(t) for r in reqs for t in r.output_ids]
    counts = torch.zeros(len(reqs), vocab, device=device)
    if cols:
        idx = (torch.tensor(rows, device=device), torch.tensor(cols, device=device).clamp(0, vocab - 1))
        counts.index_put_(idx, torch.ones(len(cols), device=device), accumulate=True)
    return counts


def scale(logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(logits < 0, logits * s, logits / s)


def stop_ids(req) -> set[int]:
    """The tokens that would end `req`, which min_new_tokens bans until it is reached: its stop_token_ids, its EOS ids
    and the tokenizer's (the set SGLang's min-new-tokens penalizer bans). Read from the request: the batch a
    speculative worker gets carries no penalizer state (SGLang's forward copy drops the orchestrator)."""
    tok = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        ids.add(getattr(tok, "eos_token_id", None))
    return {int(i) for i in ids if i is not None}


def _stop_ban(reqs, v: int, device) -> torch.Tensor:
    """[b, V]: -inf at each request's stop tokens (stop_ids), 0 elsewhere."""
    ban = torch.zeros(len(reqs), v, device=device)
    for i, r in enumerate(reqs):
        ids = [t for t in stop_ids(r) if 0 <= t < v]
        if ids:
            ban[i, ids] = float("-inf")
    return ban


def needs_history(reqs) -> bool:
    """True when some request's logits may depend on its output so far: frequency, presence or repetition penalties,
    min_new_tokens, or a custom logit processor (which may read `__req__.output_ids`: logit_chain.py)."""
    for r in reqs:
        if getattr(r, "custom_logit_processor", None):
            return True
        p = r.sampling_params
        if (p.frequency_penalty or 0.0) or (p.presence_penalty or 0.0) or (p.min_new_tokens or 0) \
                or (p.repetition_penalty is not None and p.repetition_penalty != 1.0):
            return True
    return False


def install_sync_fallback(algorithm: str) -> None:
    """Wrap SGLang's per-batch overlap switch (Scheduler.is_disable_overlap_for_batch, listed in compat.PATCHES) so
    a JETFLOW decode batch whose penalties or custom logit processors read the output history runs after the previous
    round is processed."""
    from sglang.srt.managers.scheduler import Scheduler

    def make(original):
        def is_disable_overlap_for_batch(self, batch, last_batch):
            if original(self, batch, last_batch):
                return True
            return bool(batch is not None and getattr(batch.spec_algorithm, "name", None) == algorithm
                        and batch.forward_mode.is_decode() and len(getattr(self, "result_queue", ())) > 0
                        and needs_history(batch.reqs))
        return is_disable_overlap_for_batch

    wrap(Scheduler, "is_disable_overlap_for_batch", make)


def install_prefill_history() -> None:
    """Wrap SGLang's penalizer preparation (_BatchedPenalizer.prepare, listed in compat.PATCHES) so that a request
    which already has output, one SGLang retracted when the KV pool ran short and now prefills its prompt plus output
    again, starts with its counts: SGLang's penalizers start from zero, so the token sampled at that prefill forgot the
    penalties and min_new_tokens' progress (plain SGLang shows the same under retraction). JETFLOW's decode rounds count
    from `req.output_ids` (penalise) and need no penalizer; this makes the one token sampled at prefill exact too. A
    request without output (every fresh prefill) changes nothing."""
    from sglang.srt.sampling.penaltylib.orchestrator import _BatchedPenalizer

    def make(original):
        def prepare(self):
            fresh = not self._is_prepared
            original(self)
            reqs = self.orchestrator.reqs() if fresh else ()
            if any(len(r.output_ids) for r in reqs):
                _seed(self, reqs)
        return prepare

    wrap(_BatchedPenalizer, "prepare", make)


def _seed(pen, reqs) -> None:
    """Give a freshly prepared SGLang penalizer the history of requests that already have output."""
    from sglang.srt.sampling import penaltylib as pl

    if isinstance(pen, pl.BatchedMinNewTokensPenalizer):
        pen.len_output_tokens += torch.tensor([[len(r.output_ids)] for r in reqs], dtype=pen.len_output_tokens.dtype,
                                              device=pen.len_output_tokens.device)
        return
    table = {pl.BatchedFrequencyPenalizer: ("cumulated_frequency_penalties", "frequency_penalties"),
             pl.BatchedPresencePenalizer: ("cumulated_presence_penalties", "presence_penalties"),
             pl.BatchedRepetitionPenalizer: ("cumulated_repetition_penalties", "repetition_penalties")}
    if type(pen) not in table:
        return
    acc, per_req = table[type(pen)]
    cum = getattr(pen, acc)
    counts = output_counts(reqs, cum.shape[1], cum.device)
    if isinstance(pen, pl.BatchedFrequencyPenalizer):  # each occurrence adds the penalty
        cum += counts * getattr(pen, per_req)
    else:  # presence subtracts, repetition scales, once per seen token
        setattr(pen, acc, torch.where(counts > 0, getattr(pen, per_req).expand_as(cum), cum))


def penalise(logits: torch.Tensor, batch, tree) -> torch.Tensor:
    """logits [b*n, V] of the verified nodes -> penalised copy (or `logits` itself when nothing applies)."""
    b, n = tree.tokens.shape
    params = [r.sampling_params for r in batch.reqs]
    freq = [float(p.frequency_penalty or 0.0) for p in params]
    pres = [float(p.presence_penalty or 0.0) for p in params]
    rep = [float(p.repetition_penalty if p.repetition_penalty is not None else 1.0) for p in params]
    min_new = [int(p.min_new_tokens or 0) for p in params]
    if not (any(freq) or any(pres) or any(r != 1.0 for r in rep) or any(min_new)):
        return logits
    dev, v = logits.device, logits.shape[-1]
    t = lambda xs: torch.tensor(xs, device=dev)[:, None, None]  # noqa: E731
    out = logits.float().view(b, n, v).clone()
    counts = output_counts(batch.reqs, v, dev)[:, None] + path_counts(tree.tokens, tree.ancestor_mask(), v)
    seen = (counts > 0).float()
    out -= t(freq) * counts + t(pres) * seen
    if any(min_new):
        length = torch.tensor([len(r.output_ids) for r in batch.reqs], device=dev)[:, None] + tree.depths
        ban = (length < torch.tensor(min_new, device=dev)[:, None])[..., None]
        out = out + torch.where(ban, _stop_ban(batch.reqs, v, dev)[:, None], torch.zeros_like(out))
    if any(r != 1.0 for r in rep):
        out = scale(out, torch.where(seen > 0, t(rep).expand(b, n, v), torch.ones_like(out)))
    return out.view(b * n, v).to(logits.dtype)
