"""Kernel-side tree-mask layouts, built on `jetflow_sglang.core.tree` (the one source of truth for ancestor masks).

Packed layout (what the Triton kernel and the FlashInfer variant read): int32 words [total_q, W], rows of request b at
qo_indptr[b]:qo_indptr[b+1], bit j%32 of word j//32 set when tree node j is an ancestor of the row's node or the node
itself. Column j is request-local. Prefix columns are implicit (always visible).
"""
from __future__ import annotations

import torch

from jetflow_sglang.core.tree import ancestor_mask, pack_bits, pack_ragged, unpack_bits, words_for

__all__ = ["ancestor_mask", "pack_bits", "unpack_bits", "pack_ragged", "words_for", "GRAPH_WORDS", "pad_words",
           "pad_nodes", "dense_allow", "lens_from_indptr"]

# One word count for every N <= 256 so a single CUDA graph serves every tree size up to the largest budget.
GRAPH_WORDS = 8


def lens_from_indptr(qo_indptr: torch.Tensor) -> list[int]:
    ind = [int(x) for x in qo_indptr.tolist()]
    if not ind or ind[0] != 0 or any(b < a for a, b in zip(ind, ind[1:])):
        raise ValueError(f"qo_indptr must start at 0 and be non-decreasing, got {ind}")
    return [b - a for a, b in zip(ind, ind[1:])]


def pad_words(words: torch.Tensor, total_words: int = GRAPH_WORDS) -> torch.Tensor:
    """int32 [R, w] -> [R, total_words], zero words appended (columns past the tree are never visible)."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"expected int32 [rows, words], got {words.dtype} {tuple(words.shape)}")
    if words.shape[1] > total_words:
        raise ValueError(f"mask has {words.shape[1]} words per row, more than the padded {total_words}")
    return torch.nn.functional.pad(words, (0, total_words - words.shape[1]))


def pad_nodes(words: torch.Tensor, n: int, n_pad: int) -> torch.Tensor:
    """Pad one request's packed rows [n, W] to [n_pad, W] for a fixed-size graph bucket.

    Pad rows see only themselves (self bit), so they never attend to real nodes' futures and no row is fully masked;
    real rows never see pad columns, so real outputs are unchanged.
    """
    if words.shape[0] != n or not n <= n_pad <= words.shape[1] * 32:
        raise ValueError(f"cannot pad {tuple(words.shape)} rows from n={n} to {n_pad} (max {words.shape[1] * 32})")
    pad = pack_bits(torch.eye(n_pad, dtype=torch.bool)[n:], words.shape[1])
    return torch.cat([words, pad.to(words.device)])


def dense_allow(tree_words: torch.Tensor, n: int, prefix_len: int) -> torch.Tensor:
    """Bool [n, prefix_len + n] for SDPA: prefix columns True, tree columns from the packed rows of one request."""
    tree = unpack_bits(tree_words.cpu(), n).to(tree_words.device)
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=tree.device), tree], dim=1)
