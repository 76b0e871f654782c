"""Tree-mask verify attention for transformers models, registered as attn_implementation="jetflow_tree".

    import jetflow_sglang.kernels.hf_tree_attention as hta                       # registers "jetflow_tree"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=hta.NAME)
    with hta.tree_mask_context(tree.packed_mask(), prefix_len):   # packed int32 rows [N, W] (jetflow_sglang.core.tree)
        out = model(input_ids=..., position_ids=..., past_key_values=cache, attention_mask=None)

Inside the context every attention layer sees the N new rows as a tree over the cached prefix: on CUDA through the
Triton kernel (the DynamicCache's contiguous K/V viewed as one page per request, no copy), on CPU through SDPA with a
bool mask, or with exact=True through `cpu_tree_attention` (float64, every row rounded as a one-token step rounds it:
jetflow_sglang/engine/exact.py). Outside the context the function is plain SDPA with transformers' own mask, so prefill and
ordinary decoding are unchanged.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from jetflow_sglang.kernels.tree_mask import dense_allow

NAME = "jetflow_tree"
# Route CPU tensors through the Triton kernel too (only meaningful under TRITON_INTERPRET=1; used by tests).
FORCE_TRITON = False
MIN_ROWS = 4  # BLAS takes another kernel for fewer rows (a GEMV), which rounds differently: pad up to this many
KEY_BLOCK = 64  # keys are padded to a multiple of this, so a longer row only adds whole blocks of exact zeros


@dataclass
class TreeMaskContext:
    words: torch.Tensor  # int32 [B*N, W] (or [N, W], shared by every batch row)
    prefix_len: int
    exact: bool = False  # CPU: cpu_tree_attention, so every row rounds as a one-token step does (exact.py)
    _cache: dict = field(default_factory=dict)  # per (device, B, N): tensors every layer reuses


_CTX: contextvars.ContextVar[TreeMaskContext | None] = contextvars.ContextVar("jetflow_tree_mask", default=None)


@contextmanager
def tree_mask_context(words: torch.Tensor, prefix_len: int, exact: bool = False):
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"tree mask words must be int32 [rows, W], got {words.dtype} {tuple(words.shape)}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    token = _CTX.set(TreeMaskContext(words, int(prefix_len), bool(exact)))
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
        if kind in ("sdpa", "bias"):
            rows = words.view(-1, n, words.shape[1])
            allow = torch.stack([dense_allow(r, n, ctx.prefix_len) for r in rows])
            if kind == "sdpa":  # bool [B or 1, 1, N, P+N]
                ctx._cache[key] = allow[:, None].to(device)
            else:  # float64 [B or 1, 1, 1, N, P+N padded to KEY_BLOCK]: 0 where allowed, -inf elsewhere
                allow = torch.nn.functional.pad(allow, (0, _padded_keys(ctx.prefix_len + n) - allow.shape[-1]))
                bias = torch.zeros(allow.shape, dtype=torch.float64).masked_fill_(~allow, float("-inf"))
                ctx._cache[key] = bias[:, None, None].to(device)
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
        # triton only where a GPU is (or the interpreter)
        from jetflow_sglang.kernels.triton_tree_attn import pick_splits, tree_attn_op

        t = _prepared(ctx, query.device, b, n, "triton")
        q = query.transpose(1, 2).reshape(b * n, hq, d)
        splits = 1
        if query.is_cuda:  # long prefixes: split the prefix across programs (flash-decoding)
            sms = torch.cuda.get_device_properties(query.device).multi_processor_count
            splits = pick_splits(ctx.prefix_len, n, hq, b, d, query.dtype, sms)
        # [B, Hkv, S, D] -> [B, S, Hkv, D] view: one page of S slots per request, page b = request b.
        out = tree_attn_op(q, key.transpose(1, 2), value.transpose(1, 2), t["block_table"], t["prefix_lens"],
                           t["qo_indptr"], t["words"], float(scaling), n, False, splits)
        return out.view(b, n, hq, d), None
    if ctx.exact:
        return cpu_tree_attention(query, key, value, _prepared(ctx, query.device, b, n, "bias"), scaling), None
    mask = _prepared(ctx, query.device, b, n, "sdpa")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=key.shape[1] != hq)
    return out.transpose(1, 2).contiguous(), None


def _padded_keys(n_keys: int) -> int:
    return -(-n_keys // KEY_BLOCK) * KEY_BLOCK


def cpu_tree_attention(query, key, value, bias, scaling: float) -> torch.Tensor:
    """query [B, Hq, N, D], key/value [B, Hkv, L, D], bias [B or 1, 1, 1, N, L padded] -> [B, N, Hq, D]: exact rows.

    Two products per layer in bias's dtype (float64), the query heads of one K/V head stacked as rows (GQA without
    copying K/V per head). A row comes out the same whatever else is in the batch and wherever its keys sit:
    - bf16 inputs multiply exactly in float64, and a float64 sum in any order differs by ~1e-16 relative, far below
      the output's rounding. So a node whose ancestors are scattered among other nodes' columns gets the bits of the
      one-token step that saw them in a row (with float32 products and sums such nodes were off by up to 0.4 in the
      logits, while chains matched; torch's CPU SDPA also rounds a row differently with the rows and keys around it);
    - the products always have at least MIN_ROWS rows (zero rows padded in), and keys are padded with zeros to a
      multiple of KEY_BLOCK (masked with -inf), so a one-token step and a 256-node tree take the same kernels.
    On a 2-core EPYC with AVX512-BF16 (SmolLM2-135M, bf16, 2026-12-03), 60 greedy generations (12 prompts x budgets
    3, 16, 64, 256, auto, 96 tokens) reproduced plain decoding token for token. A verify forward costs 1.0-1.4x
    SDPA's with ~190 cached tokens and 1.2-1.6x with ~590 (bench/results/cpu_attention.md; 2.9x at 256 nodes in an
    earlier run), hence opt-in."""
    b, hq, n, d = query.shape
    hkv, keys = key.shape[1], key.shape[2]
    g, pad_keys = hq // hkv, bias.shape[-1] - keys
    rows = g * n
    q = (query.to(bias.dtype) * scaling).reshape(b, hkv, rows, d)
    if rows < MIN_ROWS:
        q = torch.nn.functional.pad(q, (0, 0, 0, MIN_ROWS - rows))
    k = torch.nn.functional.pad(key.to(bias.dtype), (0, 0, 0, pad_keys))
    v = torch.nn.functional.pad(value.to(bias.dtype), (0, 0, 0, pad_keys))
    s = torch.matmul(q, k.transpose(-1, -2))[:, :, :rows].view(b, hkv, g, n, keys + pad_keys) + bias
    p = torch.softmax(s, -1).view(b, hkv, rows, keys + pad_keys)
    if rows < MIN_ROWS:
        p = torch.nn.functional.pad(p, (0, 0, 0, MIN_ROWS - rows))
    out = torch.matmul(p, v)[:, :, :rows].reshape(b, hq, n, d)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def register() -> None:
    AttentionInterface.register(NAME, jetflow_tree_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # outside the context the SDPA fallback needs SDPA's masks


register()
