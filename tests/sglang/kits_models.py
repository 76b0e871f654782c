"""A tiny random Llama with SmolLM2's real tokenizer (vocabulary 49152, 8192 positions; its head comes from
sgl_fixtures.build_tiny_head), for the SGLang kits whose requests need a wide vocabulary and long prompts (the
radix-attention kit sends token ids up to 31999 and prompts of thousands of tokens; the mixed-logprob kit's prompts
are token ids 0..1999) but not a model that writes sensible text. tests/sglang/sgl_fixtures.py's tiny Qwen3 has 376
tokens and 512 positions. Built in a few seconds, no network: the tokenizer is copied from the default target's
folder."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_llama_wide(out, tokenizer_from, seed: int = 0) -> Path:
    """A 4-layer random Llama (hidden 64) with the tokenizer and chat template of `tokenizer_from`, saved as an HF
    folder (fp32 weights)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # wider logit gaps than the default init (as sgl_fixtures does): no float near-ties
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out
