"""The JetFlow draft head: a few decoder layers over [anchor, MASK x (B-1)] with target features injected as K/V.

The fused target features of the committed context enter every draft layer as extra keys/values through that layer's
own k/v projections (DFlash style). Context rows produce no queries. Embeddings and the LM head are the target's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetflow_sglang.core import rowgemm
from jetflow_sglang.head.config import JetFlowHeadConfig

MASK = -1  # token id meaning "the learned mask embedding"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama RoPE tables for positions [B, S]: (cos, sin) [B, 1, S, D] in float32, computed once per forward and
    shared by every layer's queries and keys (a block forward used to rebuild them four times)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[:, None, :, None] * inv  # [B,1,S,D/2]
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of x [B, H, S, D] with tables from `rope`."""
    cos, sin = cos_sin
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, cfg: JetFlowHeadConfig):
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.cfg.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of already-normalised rows x [B, S, d] -> [B, Hkv, S, D] each (keys rotated by `rope`)."""
        k = self.k_norm(self._heads(self.k_proj(x), self.cfg.num_kv_heads))
        v = self._heads(self.v_proj(x), self.cfg.num_kv_heads)
        return rotate(k, cos_sin), v

    def qkv(self, x: torch.Tensor, cos_sin, weight: torch.Tensor | None = None):
        """Rotated queries, rotated keys and values of normalised rows x [B, S, d]. weight (inference): the three
        projections stacked (`fused_weights()[0]`), one GEMM."""
        if weight is None:
            q = rotate(self.q_norm(self._heads(self.q_proj(x), self.cfg.num_heads)), cos_sin)
            return (q,) + self.kv(x, cos_sin)
        cfg = self.cfg
        kv_width = cfg.num_kv_heads * cfg.head_dim
        q, k, v = rowgemm.linear(x, weight).split([cfg.num_heads * cfg.head_dim, kv_width, kv_width], -1)
        q, k = self.q_norm(self._heads(q, cfg.num_heads)), self.k_norm(self._heads(k, cfg.num_kv_heads))
        return rotate(q, cos_sin), rotate(k, cos_sin), self._heads(v, cfg.num_kv_heads)

    def mlp(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU of normalised rows; weight (inference): gate_proj and up_proj stacked (`fused_weights()[1]`)."""
        if weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = rowgemm.linear(x, weight).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k, v projections stacked; gate and up stacked) for inference: fewer, larger GEMMs per draft forward,
        where each op costs more than its FLOPs. Copies: make them again after the weights change."""
        return (torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach(),
                torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach())

    def forward(self, h, cos_sin, ctx, mask, fused: tuple | None = None):
        """ctx: the context's padded (k, v) [B, Hkv, T, D] with mask [B, S, T + S]; or an object whose
        `attend(q, k, v, mask)` reads the context where it lives (sglang/head_pool.PagedLayer: the server's pool, by
        slot) with the block's own mask [B, S, S]."""
        qkv_w, mlp_w = fused or (None, None)
        x = self.input_layernorm(h)
        q, k, v = self.qkv(x, cos_sin, qkv_w)
        if hasattr(ctx, "attend"):
            o = ctx.attend(q, k, v, mask)
        else:
            k, v = torch.cat([ctx[0], k], 2), torch.cat([ctx[1], v], 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                               enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads)
        h = h + self.o_proj(o.transpose(1, 2).flatten(2))
        return h + self.mlp(self.post_attention_layernorm(h), mlp_w)


class JetFlowHead(nn.Module):
    def __init__(self, cfg: JetFlowHeadConfig):
        super().__init__()
        self.config = cfg
        n_taps = len(cfg.tap_layers)
        self.fc = nn.Linear(n_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        vocab = cfg.draft_vocab_size or cfg.target["vocab_size"]
        self.register_buffer("vocab_ids", torch.arange(vocab, dtype=torch.long))
        self._target: tuple = ()  # (embedding, lm_head weight) borrowed from the target; never saved

    # -- binding to the target -------------------------------------------------------------------------------
    def bind(self, target_model) -> "JetFlowHead":
        self.config.check_target(target_model.config)
        self._target = (target_model.get_input_embeddings(), target_model.get_output_embeddings())
        return self

    @property
    def bound(self) -> bool:
        return bool(self._target)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] with MASK (-1) slots -> [B, S, d]. Released heads embed their mask token with the target's
        embedding; this project's heads use their own learned mask embedding."""
        if self.config.mask_token_id is not None:
            return self._target[0](tokens.masked_fill(tokens == MASK, self.config.mask_token_id)).to(self.mask_embedding.dtype)
        emb = self._target[0](tokens.clamp(min=0)).to(self.mask_embedding.dtype)
        return torch.where((tokens == MASK)[..., None], self.mask_embedding.expand_as(emb), emb)

    def lm_weight(self) -> torch.Tensor:
        w = self._target[1].weight
        if self.config.draft_vocab_size:
            w = w[self.vocab_ids]  # row gather; cached by the drafter for the hot path
        return w

    # -- forward ---------------------------------------------------------------------------------------------
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor,
                   kv_weight: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [B, T, n_taps*H] of committed rows -> per-layer (k, v) [B, Hkv, T, D].

        kv_weight (inference): `fused_kv_weight()`, so every layer's keys and values come from one GEMM and one RoPE
        (the same maths; drafters call this every round with a few rows, where each op costs more than its FLOPs)."""
        c = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos_sin = self.rope(positions)
        if kv_weight is None:
            return [layer.kv(c, cos_sin) for layer in self.layers]
        cfg, n = self.config, len(self.layers)
        b, t, _ = c.shape
        kv = rowgemm.linear(c, kv_weight).view(b, t, n, 2, cfg.num_kv_heads, cfg.head_dim)
        keys = kv[:, :, :, 0].permute(0, 2, 3, 1, 4)  # [B, L, Hkv, T, D]
        if cfg.qk_norm:
            keys = torch.stack([layer.k_norm(keys[:, i]) for i, layer in enumerate(self.layers)], 1)
        keys = rotate(keys.reshape(b, n * cfg.num_kv_heads, t, cfg.head_dim), cos_sin)
        keys = keys.view(b, n, cfg.num_kv_heads, t, cfg.head_dim)
        values = kv[:, :, :, 1].permute(0, 2, 3, 1, 4)
        return [(keys[:, i], values[:, i]) for i in range(n)]

    def fused_kv_weight(self) -> torch.Tensor:
        """Every layer's k_proj and v_proj stacked into one [L * 2 * Hkv * D, d] weight (a copy: make it again after
        the weights change)."""
        return torch.cat([w for layer in self.layers for w in (layer.k_proj.weight, layer.v_proj.weight)]).detach()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor,
                fused=None) -> torch.Tensor:
        """tokens/positions [B, S]; mask [B, S, T_ctx + S] bool (True = attend; a paged context: [B, S, S], the
        context seen up to each request's length). Returns normed hidden [B, S, d].
        fused (inference): each layer's `fused_weights()`."""
        h = self.embed(tokens)
        cos_sin = self.rope(positions)
        for layer, ctx, f in zip(self.layers, ctx_kv, fused or [None] * len(self.layers)):
            h = layer(h, cos_sin, ctx, mask, f)
        return self.norm(h)

    def rope(self, positions: torch.Tensor):
        return rope(positions, self.config.head_dim, self.config.rope_theta)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.lm_weight() if weight is None else weight
        # One 2-D GEMM: a [1, S, d] slice of a longer block keeps its outer stride, and matmul then takes a batched
        # path that is ~20x slower on CPU in bf16.
        flat = hidden.to(w.dtype).reshape(-1, hidden.shape[-1])
        return rowgemm.linear(flat, w).view(*hidden.shape[:-1], w.shape[0])

    def block_mask(self, n_ctx: int, size: int, device=None) -> torch.Tensor:
        """[size, n_ctx + size]: every slot sees the context; in-block causal (JetFlow) or bidirectional (DFlash)."""
        inner = torch.ones(size, size, dtype=torch.bool, device=device)
        if self.config.causal:
            inner = inner.tril()
        return torch.cat([torch.ones(size, n_ctx, dtype=torch.bool, device=device), inner], 1)


@torch.no_grad()
def init_from_target(head: JetFlowHead, target_model) -> JetFlowHead:
    """Start from the target's last layers and final norm; fc passes the deepest tap through.

    A random fc learned about half as fast in the calibration run (../shared/notes/training.md).
    """
    cfg = head.config
    layers = target_model.model.layers
    src = layers[len(layers) - cfg.num_layers:]
    for dst, s in zip(head.layers, src):
        own = dst.state_dict()
        theirs = {k.replace("self_attn.", "").replace("mlp.", ""): v for k, v in s.state_dict().items()}
        dst.load_state_dict({k: theirs[k] for k in own if k in theirs}, strict=False)
    head.norm.weight.copy_(target_model.model.norm.weight)
    h = cfg.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, -h:] = torch.eye(h)
    head.hidden_norm.weight.copy_(src[0].input_layernorm.weight)
    head.mask_embedding.copy_(target_model.get_input_embeddings().weight.float().mean(0))
    return head
