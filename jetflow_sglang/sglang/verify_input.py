"""The verify input JETFLOW hands SGLang's attention backends, and the tree -> tensors packing.

It keeps NGRAM's layout (SpecInputType.NGRAM_VERIFY): an irregular tree of a fixed `n` nodes per request, the
tree mask as QLEN_ONLY (n*n per request) on CPU or FULL (n*(L+n), prefix columns True) elsewhere, which is what
SGLang's triton/flashinfer custom-mask verify paths read. NGRAM's filter/merge/attn-arg code is reused as is.
"""
from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from ..tree import DraftTree


class JetFlowVerifyInput(NgramVerifyInput):
    def __init__(self, *args, capture_hidden_mode=CaptureHiddenMode.NULL, **kwargs):
        super().__init__(*args, **kwargs)
        self.capture_hidden_mode = capture_hidden_mode


def pack_trees(trees: list[DraftTree], n: int, seq_lens: list[int], full_mask: bool, device):
    """Pad every tree to n nodes and pack them for TARGET_VERIFY.

    Padding nodes hang off the root with their own token = the root's; they see only the prefix, the root and
    themselves, and acceptance never looks at them (it walks the real tree), so they only cost compute.
    Returns (draft_tokens[bs*n], custom_mask (flat bool), positions[bs*n], retrieve_index/next_token/next_sibling
    [bs, n]).
    """
    bs = len(trees)
    tokens = torch.empty(bs, n, dtype=torch.int64)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    depth = torch.ones(bs, n, dtype=torch.int64)
    next_token = torch.full((bs, n), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    for i, t in enumerate(trees):
        m = len(t)
        if m > n:
            raise ValueError(f"drafter returned {m} nodes for a budget of {n}")
        tokens[i, :m] = torch.tensor(t.tokens)
        tokens[i, m:] = t.tokens[0]
        mask[i, :m, :m] = t.ancestor_mask()
        mask[i, m:, 0] = True
        mask[i, torch.arange(m, n), torch.arange(m, n)] = True
        depth[i, :m] = torch.tensor(t.depths)
        for node in range(m):  # first child / next sibling links, as SGLang's tree kernels define them
            kids = t.children(node)
            next_token[i, node] = kids[0] if kids else -1
            for a, b in zip(kids, kids[1:]):
                next_sibling[i, a] = b
    positions = (torch.tensor(seq_lens, dtype=torch.int64)[:, None] + depth).flatten()
    if full_mask:
        custom = torch.cat([torch.cat([torch.ones(n, L, dtype=torch.bool), mask[i]], 1).flatten()
                            for i, L in enumerate(seq_lens)])
    else:
        custom = mask.flatten()
    retrieve_index = torch.arange(bs * n, dtype=torch.int64).view(bs, n)
    to = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return (to(tokens.flatten()), to(custom), to(positions), to(retrieve_index), to(next_token), to(next_sibling))
