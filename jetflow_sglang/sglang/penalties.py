"""Frequency, presence, repetition and min-new-tokens penalties applied per tree path (lossless with penalties).

SGLang's speculative path penalises every draft node with the counts of the tokens committed before the round
("a relaxed version of penalties for speculative decoding"), and its scheduler feeds the penalizers only the last
token of each round. Here:
- `commit` feeds the penalizers the other accepted tokens of the round, so their committed state is exact;
- `apply` penalises node i's logits with the committed counts plus the drafted tokens on i's own path (root
  excluded: it is the last committed token, already counted), and lifts min-new-tokens' stop-token ban at the
  depth where the path reaches it. Order as SGLang's speculative path: additive penalties, then scaling.
The penalizers' tensors are SGLang 0.5.23's (sampling/penaltylib); nothing runs when no request uses penalties.
"""
from __future__ import annotations

import torch

from sglang.srt.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from sglang.srt.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from sglang.srt.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from sglang.srt.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer


def _active(info):
    orch = getattr(info, "penalizer_orchestrator", None)
    if orch is None or not orch.is_required:
        return None
    return {cls: p for cls, p in orch.penalizers.items() if getattr(p, "_is_prepared", False)}


def path_counts(tokens: torch.Tensor, anc: torch.Tensor, vocab: int) -> torch.Tensor:
    """[b, n, V] float: how often each token occurs on node i's path, the root excluded."""
    b, n = tokens.shape
    onehot = torch.zeros(b, n, vocab, device=tokens.device).scatter_(2, tokens[..., None].clamp(0, vocab - 1), 1.0)
    anc = anc.float().clone()
    anc[:, :, 0] = 0.0
    return torch.bmm(anc, onehot)


def scale(logits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(logits < 0, logits * s, logits / s)


class PathPenalties:
    def apply(self, logits: torch.Tensor, info, tree) -> torch.Tensor:
        """logits [b*n, V] of the verified nodes -> penalised copy (or `logits` itself when nothing applies)."""
        pens = _active(info)
        if info.logit_bias is not None:
            logits = logits + info.logit_bias.repeat_interleave(tree.tokens.shape[1], 0)
        if not pens:
            return logits
        b, n = tree.tokens.shape
        v = logits.shape[-1]
        out = logits.float().view(b, n, v).clone()
        counts = path_counts(tree.tokens, tree.ancestor_mask(), v)
        on_path = counts > 0
        freq = pens.get(BatchedFrequencyPenalizer)
        if freq is not None:
            out -= freq.cumulated_frequency_penalties[:, None] + freq.frequency_penalties[:, :, None] * counts
        pres = pens.get(BatchedPresencePenalizer)
        if pres is not None:
            committed = pres.cumulated_presence_penalties[:, None]
            out -= torch.where(on_path, pres.presence_penalties[:, :, None].expand(b, n, v), committed.expand(b, n, v))
        mnt = pens.get(BatchedMinNewTokensPenalizer)
        if mnt is not None:
            length = mnt.len_output_tokens.view(b, 1) + tree.depths  # output length when node i's child is emitted
            ban = (length < mnt.min_new_tokens.view(b, 1))[..., None]
            out += torch.where(ban, mnt.stop_token_penalties[:, None], torch.zeros_like(out))
        rep = pens.get(BatchedRepetitionPenalizer)
        if rep is not None:
            s = torch.where(on_path, rep.repetition_penalties[:, :, None].expand(b, n, v),
                            rep.cumulated_repetition_penalties[:, None].expand(b, n, v))
            out = scale(out, s)
        return out.view(b * n, v).to(logits.dtype)

    def commit(self, info, emitted: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """Feed the penalizers the tokens of this round that the scheduler does not (all but the last emitted)."""
        pens = _active(info)
        if not pens:
            return
        b, width = emitted.shape
        cols = torch.arange(width, device=emitted.device)[None]
        fed = (cols < (accept_lens.long() - 1)[:, None])  # [b, width]
        ids = emitted.long().clamp(min=0)
        freq = pens.get(BatchedFrequencyPenalizer)
        if freq is not None:
            freq.cumulated_frequency_penalties.scatter_add_(1, ids, fed.float() * freq.frequency_penalties)
        hit = None
        for cls, attr, val in ((BatchedPresencePenalizer, "cumulated_presence_penalties", "presence_penalties"),
                               (BatchedRepetitionPenalizer, "cumulated_repetition_penalties", "repetition_penalties")):
            p = pens.get(cls)
            if p is None:
                continue
            cum = getattr(p, attr)
            if hit is None:
                hit = torch.zeros_like(cum).scatter_add_(1, ids, fed.to(cum.dtype)) > 0
            setattr(p, attr, torch.where(hit, getattr(p, val).expand_as(cum), cum))
        mnt = pens.get(BatchedMinNewTokensPenalizer)
        if mnt is not None:
            mnt.len_output_tokens += fed.sum(1, keepdim=True).to(mnt.len_output_tokens.dtype)
