"""The engines that let a target continue training prompts: HF `generate` (the fallback, any machine with torch) and
SGLang's offline `sglang.Engine` (batched, continuous batching; the fast way on a GPU).

Both take prompt token ids (the chat template is applied by the caller, data.chat_ids) and return each continuation
cut after its first EOS (EOS kept), so `data.regenerate` writes the same records whichever engine ran.
"""
from __future__ import annotations

import os
from typing import Protocol

ENGINES = ("hf", "sglang")


class Continuer(Protocol):
    eos_ids: set[int]

    def continue_batch(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                       seeds: list[int]) -> list[list[int]]: ...


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    cut = next((i + 1 for i, t in enumerate(ids) if t in eos_ids), len(ids))
    return list(ids[:cut])


def model_eos_ids(config, generation_config, tokenizer) -> set[int]:
    """Every id the target stops on: the tokenizer's EOS plus the generation config's (chat models list several)."""
    out = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for src in (generation_config, config):
        g = getattr(src, "eos_token_id", None) if src is not None else None
        out |= set(g if isinstance(g, (list, tuple)) else [] if g is None else [g])
    if not out:
        raise ValueError("the target defines no EOS token (tokenizer, generation_config and config all lack one)")
    return out


def generate_batch(model, prompt_ids: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                   temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """Left-padded batched generation; returns each continuation cut after its first EOS (EOS kept)."""
    import torch

    L = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompt_ids])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompt_ids])
    kw = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    torch.manual_seed(seed)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=sorted(eos_ids), min_new_tokens=1, **kw)
    return [cut_at_eos(row, eos_ids) for row in out[:, L:].tolist()]


class HFContinuer:
    """Left-padded batches through `model.generate` (one seed per batch: HF samples a batch from one generator)."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.eos_ids = model_eos_ids(model.config, getattr(model, "generation_config", None), tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def continue_batch(self, prompt_ids, max_new_tokens, temperature, seeds):
        return generate_batch(self.model, prompt_ids, max_new_tokens, self.eos_ids, self.pad_id, temperature,
                              seed=seeds[0])


class SGLangContinuer:
    """`sglang.Engine` over token ids. Greedy at temperature 0; sampled prompts get their own `sampling_seed`, so a
    prompt's continuation does not depend on its batch. Use as a context manager (the engine owns subprocesses)."""

    def __init__(self, model_path: str, tokenizer, device: str = "cuda", dtype: str = "bfloat16",
                 max_total_tokens: int | None = None, max_running_requests: int | None = None, seed: int = 0,
                 mem_fraction_static: float | None = None, env=None):
        env = os.environ if env is None else env
        if device == "cpu" and env.get("JETFLOW_SGLANG_CPU") != "1":
            raise RuntimeError("SGLang on CPU needs JETFLOW_SGLANG_CPU=1 in the environment before Python starts "
                               "(see docs/SERVING.md); or use --engine hf")
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(f"--engine sglang needs SGLang (pip install 'jetflow-sglang[sglang]'): {e}; "
                               "or use --engine hf") from None
        from transformers import AutoConfig, GenerationConfig

        try:
            gen_cfg = GenerationConfig.from_pretrained(model_path)
        except OSError:
            gen_cfg = None
        self.eos_ids = model_eos_ids(AutoConfig.from_pretrained(model_path), gen_cfg, tokenizer)
        # the tokenizer stays on: SGLang needs it for min_new_tokens (EOS suppression on the first token)
        kw = dict(model_path=model_path, device=device, dtype=dtype, random_seed=seed, log_level="error")
        if max_total_tokens:
            kw["max_total_tokens"] = max_total_tokens
        if max_running_requests:
            kw["max_running_requests"] = max_running_requests
        if mem_fraction_static:
            kw["mem_fraction_static"] = mem_fraction_static
        self.engine = sglang.Engine(**kw)

    def continue_batch(self, prompt_ids, max_new_tokens, temperature, seeds):
        params = []
        for s in seeds:
            p = {"max_new_tokens": max_new_tokens, "min_new_tokens": 1, "stop_token_ids": sorted(self.eos_ids),
                 "temperature": float(temperature)}
            if temperature > 0:
                p.update(top_k=-1, top_p=1.0, sampling_seed=int(s))
            params.append(p)
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_ids], sampling_params=params)
        conts = []
        for o in outs:
            ids = list(o["output_ids"])
            fin = (o.get("meta_info") or {}).get("finish_reason") or {}
            matched = fin.get("matched") if isinstance(fin, dict) else None
            if fin.get("type") == "stop" and isinstance(matched, int) and matched in self.eos_ids \
                    and (not ids or ids[-1] != matched):
                ids.append(matched)  # keep the EOS, as the HF path does
            conts.append(cut_at_eos(ids, self.eos_ids))
        return conts

    def close(self):
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
