"""The verify input JETFLOW hands SGLang's attention backends, the carry between rounds, and the batched
tree -> verify tensors packing.

It keeps NGRAM's layout (SpecInputType.NGRAM_VERIFY): an irregular tree of a fixed `n` nodes per request, the
tree mask as QLEN_ONLY (n*n per request) on CPU or FULL (n*(L+n), prefix columns True) elsewhere, which is what
SGLang's triton/flashinfer custom-mask verify paths read. NGRAM's filter/merge/attn-arg code is reused as is.
Everything is built on the device from padded tree tensors; nothing loops over requests.
"""
from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType


class JetFlowVerifyInput(NgramVerifyInput):
    def __init__(self, *args, capture_hidden_mode=CaptureHiddenMode.NULL, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture_hidden_mode = capture_hidden_mode


class JetFlowCarry(SpecInput):
    """What each request carries from one round to the next: its last emitted token (the next round's anchor,
    `bonus_tokens`) and its committed length. One row per request, so SGLang's filter/merge never depend on the
    tree size a round used (budgets vary under `auto`). On the overlap scheduler SGLang relays both through its
    FutureMap (`future_indices` set; it writes `bonus_tokens` back before the next round); the EAGLE-shaped fields
    its relay reads are empty."""

    topk_p = topk_index = hidden_states = draft_probs = None

    def __init__(self, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor, future_indices=None):
        super().__init__(SpecInputType.EAGLE_DRAFT)
        self.bonus_tokens, self.new_seq_lens, self.future_indices = bonus_tokens, new_seq_lens, future_indices
        self.num_tokens_per_req = self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu=None):
        if self.future_indices is not None:
            self.future_indices = self.future_indices[new_indices]
            return
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: "JetFlowCarry"):
        if self.future_indices is not None:
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
            return
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])
        self.new_seq_lens = torch.cat([self.new_seq_lens, other.new_seq_lens])


def tree_links(parents: torch.Tensor, sizes: torch.Tensor):
    """First-child / next-sibling links [b, n] (-1 = none) as SGLang's tree kernels define them; padding nodes
    (index >= size) are linked to nothing."""
    b, n = parents.shape
    ar = torch.arange(n, device=parents.device)
    valid = ar[None] < sizes[:, None]
    real_child = valid & (ar[None] > 0)
    none = torch.full((b, n), n, dtype=torch.long, device=parents.device)
    is_child = (parents[:, None, :] == ar[None, :, None]) & real_child[:, None, :]  # [b, parent, child]
    first = torch.where(is_child, ar[None, None], none[:, :, None]).min(2).values
    same = (parents[:, :, None] == parents[:, None, :]) & real_child[:, :, None] & real_child[:, None, :]
    later = same & (ar[None, None, :] > ar[None, :, None])  # [b, node, sibling after it]
    sib = torch.where(later, ar[None, None], none[:, :, None]).min(2).values
    fix = lambda x: torch.where((x >= n) | ~valid, torch.full_like(x, -1), x)  # noqa: E731
    return fix(first), fix(sib)


def verify_mask(anc: torch.Tensor, seq_lens: torch.Tensor, full: bool, max_len: int | None = None,
                total_len: int | None = None) -> torch.Tensor:
    """Flat bool custom mask. anc [b, n, n] ancestor-or-self rows. QLEN_ONLY: the anc blocks; FULL: per request an
    [n, L + n] block whose first L columns are True, back to back (host bounds: max_len >= max(seq_lens) and
    total_len >= sum(seq_lens); a larger total leaves unread False at the end). Fixed shapes from the host bounds and
    a scatter, no boolean index: nothing waits for the device."""
    if not full:
        return anc.reshape(-1)
    b, n, _ = anc.shape
    L = seq_lens.long()
    total_len = int(L.sum()) if total_len is None else int(total_len)  # the host bound, when the caller has one
    # a host bound below a request's length would cut its rows short, and SGLang's NGRAM input pads a short mask with
    # True (tree nodes would see non-ancestors): refuse on the device instead, without waiting for it
    torch._assert_async(torch.all(L <= int(max_len)) & (L.sum() <= total_len),
                        "verify_mask: a host bound is below the sequence lengths")
    width = int(max_len) + n
    cols = torch.arange(width, device=anc.device)
    grid = cols[None, None].expand(b, n, width)
    Lc = L[:, None, None]
    in_tree = (grid >= Lc) & (grid < Lc + n)
    tree_vals = anc.gather(2, (grid - Lc).clamp(0, n - 1))
    vals = (grid < Lc) | (in_tree & tree_vals)
    row = (L + n)[:, None, None]  # each request's row length
    start = n * (torch.cumsum(L + n, 0) - (L + n))  # where each request's block starts
    flat = start[:, None, None] + torch.arange(n, device=anc.device)[None, :, None] * row + grid
    size = n * (total_len + b * n)
    flat = torch.where(grid < row, flat, torch.full_like(flat, size))  # past a row's end: the dump slot
    out = torch.zeros(size + 1, dtype=torch.bool, device=anc.device)
    return out.scatter_(0, flat.reshape(-1), vals.reshape(-1))[:size]


def verify_tensors(tokens, parents, depths, sizes, anc, seq_lens, full: bool, max_len: int | None = None,
                   total_len: int | None = None):
    """(draft_token [b*n], custom_mask, positions [b*n], retrieve_index/next_token/next_sibling [b, n])."""
    b, n = tokens.shape
    positions = (seq_lens.long()[:, None] + depths.long()).reshape(-1)
    first, sib = tree_links(parents, sizes)
    retrieve_index = torch.arange(b * n, device=tokens.device).view(b, n)
    return (tokens.reshape(-1), verify_mask(anc, seq_lens, full, max_len, total_len), positions, retrieve_index, first, sib)
