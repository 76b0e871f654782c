"""Tree-mask verify attention for transformers models, registered as attn_implementation="jetflow_tree".

    import kernels.hf_tree_attention as hta                       # registers "jetflow_tree"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=hta.NAME)
    with hta.tree_mask_context(tree.packed_mask(), prefix_len):   # packed int32 rows [N, W] (jetflow_sglang.tree)
        out = model(input_ids=..., position_ids=..., past_key_values=cache, attention_mask=None)

Inside the context every attention layer sees the N new rows as a tree over the cached prefix: on CUDA through the
Triton kernel (the DynamicCache's contiguous K/V viewed as one page per request, no copy), on CPU through SDPA with a
bool mask. Outside the context the function is plain SDPA with transformers' own mask, so prefill and ordinary decoding
are unchanged.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .tree_mask import dense_allow

NAME = "jetflow_tree"
# Route CPU tensors through the Triton kernel too (only meaningful under TRITON_INTERPRET=1; used by tests).
FORCE_TRITON = False


@dataclass
class TreeMaskContext:
    words: torch.Tensor  # int32 [B*N, W] (or [N, W], shared by every batch row)
    prefix_len: int
    _cache: dict = field(default_factory=dict)  # per (device, B, N): tensors every layer reuses


_CTX: contextvars.ContextVar[TreeMaskContext | None] = contextvars.ContextVar("jetflow_tree_mask", default=None)


@contextmanager
def tree_mask_context(words: torch.Tensor, prefix_len: int):
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"tree mask words must be int32 [rows, W], got {words.dtype} {tuple(words.shape)}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    token = _CTX.set(TreeMaskContext(words, int(prefix_len)))
    try:
        yield
    finally:
        _CTX.reset(token)


def _prepared(ctx: TreeMaskContext, device: torch.device, b: int, n: int, kind: str):
    key = (kind, str(device), b, n)
    if key not in ctx._cache:
        words = ctx.words
        if words.shape[0] not in (n, b * n):
            raise ValueError(f"tree mask has {words.shape[0]} rows for batch {b} x {n} query rows")
        if words.shape[1] * 32 < n:
            raise ValueError(f"{words.shape[1]} mask words per row cannot describe {n} tree nodes")
        if kind == "sdpa":  # bool [B or 1, 1, N, P+N]
            rows = words.view(-1, n, words.shape[1])
            ctx._cache[key] = torch.stack([dense_allow(r, n, ctx.prefix_len) for r in rows])[:, None].to(device)
        else:
            words = (words if words.shape[0] == b * n else words.repeat(b, 1)).to(device).contiguous()
            ctx._cache[key] = dict(
                words=words, block_table=torch.arange(b, dtype=torch.int32, device=device)[:, None],
                prefix_lens=torch.full((b,), ctx.prefix_len, dtype=torch.int32, device=device),
                qo_indptr=torch.arange(0, b * n + 1, n, dtype=torch.int32, device=device))
    return ctx._cache[key]


def jetflow_tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, Hq, N, D], key/value [B, Hkv, P+N, D] (cache already updated) -> ([B, N, Hq, D], None)."""
    ctx = _CTX.get()
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise NotImplementedError("jetflow_tree does not support sliding-window layers")
    b, hq, n, d = query.shape
    if key.shape[2] != ctx.prefix_len + n:
        raise ValueError(f"the layer's K/V hold {key.shape[2]} positions, expected prefix {ctx.prefix_len} + {n} tree "
                         "nodes: set prefix_len to the number of cached tokens before this forward")
    scaling = d ** -0.5 if scaling is None else scaling
    if query.is_cuda or FORCE_TRITON:
        from .triton_tree_attn import tree_attn_op  # triton only where a GPU is

        t = _prepared(ctx, query.device, b, n, "triton")
        q = query.transpose(1, 2).reshape(b * n, hq, d)
        # [B, Hkv, S, D] -> [B, S, Hkv, D] view: one page of S slots per request, page b = request b.
        out = tree_attn_op(q, key.transpose(1, 2), value.transpose(1, 2), t["block_table"], t["prefix_lens"],
                           t["qo_indptr"], t["words"], float(scaling), n, False)
        return out.view(b, n, hq, d), None
    mask = _prepared(ctx, query.device, b, n, "sdpa")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=key.shape[1] != hq)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(NAME, jetflow_tree_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # outside the context the SDPA fallback needs SDPA's masks


register()
