"""Tiny, fully local models for the SGLang tests: a random Qwen3 target with a trained byte-level BPE tokenizer and
chat template, and a JetFlow head for it built with the core's head classes. Built in ~1 s, no network."""
from __future__ import annotations

import os
from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts a tree of tokens and the target verifies them in one forward pass.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Once upon a time there was a tiny model that served requests on a CPU.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "SGLang schedules requests with continuous batching and a radix cache.",
]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=376, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _build_tiny(out, family: str, seed: int) -> Path:
    """A 4-layer random Qwen3 or Qwen2 (hidden 64) with the tiny tokenizer, saved as an HF folder (fp32 weights)."""
    import transformers
    from transformers import GenerationConfig

    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    config_cls, model_cls = (getattr(transformers, f"{family}{k}") for k in ("Config", "ForCausalLM"))
    cfg = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=None, torch_dtype="float32", **({"head_dim": 16} if family == "Qwen3" else {}))
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # wider logit gaps than the default init, so float noise cannot flip a greedy choice;
        model.lm_head.weight.mul_(4.0)  # untied, so the model does not just repeat its last token
        if family == "Qwen2":  # non-zero biases, so a missing bias would change the output
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.05)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def build_tiny_qwen3(out, seed: int = 0) -> Path:
    """A 4-layer random Qwen3 (hidden 64) saved as an HF folder (fp32 weights)."""
    return _build_tiny(out, "Qwen3", seed)


def build_tiny_qwen2(out, seed: int = 0) -> Path:
    """A 4-layer random Qwen2 (Qwen2.5 shares the architecture; q/k/v biases, no q/k norm), same tokenizer."""
    return _build_tiny(out, "Qwen2", seed)


def session_models() -> Path:
    """The test session's folder of tiny models (under the session's private cache, tests/conftest.py): each model is
    built once per session, and every module that uses it passes the same path, so the server pool (pool.py) can
    share their servers."""
    return Path(os.environ["JETFLOW_CACHE"]) / "tiny-models"


def shared_tiny(family: str = "Qwen3", seed: int = 0) -> Path:
    """The session's tiny random Qwen3/Qwen2 target (built on first use)."""
    return _build_tiny(session_models() / f"tiny-{family.lower()}-{seed}", family, seed)


def shared_head(target, seed: int = 1, causal: bool = True) -> Path:
    """The session's tiny head for `target` (built on first use, beside it)."""
    target = Path(target)
    return build_tiny_head(target, target.with_name(f"{target.name}-head-{seed}-{'causal' if causal else 'bidir'}"),
                           seed, causal)


def tiny_jetflow_server(root: Path, family: str, budget: int, *extra: str, env: dict | None = None,
                        spawn: bool = False):
    """Yields a started float32 JETFLOW server on a tiny random Qwen3/Qwen2 target with a tiny head (and `extra`
    flags, `env` on top of the test environment), and the target's folder; the server is stopped afterwards (a module
    fixture's body)."""
    from tests.sglang.sgl_server import jetflow_server

    target = _build_tiny(root / f"tiny-{family.lower()}", family, 0)
    head = build_tiny_head(target, root / "tiny-head")
    srv = jetflow_server(target, head, root / "server.log", budget, *extra, env=env, spawn=spawn)
    try:
        yield srv.wait_ready(), target
    finally:
        srv.stop()


def build_tiny_head(target_dir, out, seed: int = 1, causal: bool = True) -> Path:
    """A 1-layer JetFlow head (causal, or bidirectional like DFlash) tapping layers 1 and 2 of the tiny target,
    initialised from the target."""
    from transformers import AutoModelForCausalLM

    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, init_from_target, save_head

    out = Path(out)
    if (out / "config.json").exists():
        return out
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = JetFlowHeadConfig.for_target(target.config, num_layers=1, n_taps=2, causal=causal, block_size=8)
    cfg.tap_layers = [1, 2]
    torch.manual_seed(seed)
    head = init_from_target(JetFlowHead(cfg), target)
    save_head(head, out, dtype=torch.float32)
    return out


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Plain argmax loop with HF transformers (`model`: a loaded model or its folder): the losslessness reference
    (HF generate's min_new_tokens would suppress EOS, so it is no reference for ignore_eos)."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if stop_at_eos and nxt == eos:
                break
    return out
