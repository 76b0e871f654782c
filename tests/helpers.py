"""Tiny random targets and heads, built in the tests themselves."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, init_from_target
from jetflow_sglang.engine.target import Target

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny_model(family: str = "llama", vocab: int = 64, seed: int = 0, layers: int = 2, hidden: int = 32, max_pos: int = 512):
    torch.manual_seed(seed)
    cfg_cls, model_cls = FAMILIES[family]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=max_pos,
                  tie_word_embeddings=family == "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = model_cls(cfg).float().eval()
    # Sharper logits make outputs repetitive enough that drafts get accepted.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def tiny_target(family="llama", **kw) -> Target:
    return Target(tiny_model(family, **kw), tap_layers=None)


def tiny_head(model, causal=True, seed=1, draft_vocab_size=0) -> JetFlowHead:
    torch.manual_seed(seed)
    cfg = JetFlowHeadConfig.for_target(model.config, causal=causal, draft_vocab_size=draft_vocab_size)
    head = JetFlowHead(cfg)
    init_from_target(head, model)
    with torch.no_grad():  # perturb so heads differ from a copy of the target's last layers
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if draft_vocab_size:
        head.vocab_ids.copy_(torch.randperm(cfg.target["vocab_size"])[:draft_vocab_size])
    return head.float().eval().bind(model)
