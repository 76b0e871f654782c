#!/usr/bin/env python
"""Regenerate draft-head training data: the target continues training prompts with its own chat template.

    python scripts/regenerate.py --out runs/regen/smollm2.jsonl --tokens 135000

Resumable: rerun the same command and it continues where it stopped. See docs/TRAINING.md.
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jetflow_sglang.train import data as D


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF folder of the target (default: the packaged SmolLM2)")
    ap.add_argument("--out", required=True, help="jsonl of token-id records (appended)")
    ap.add_argument("--tokens", type=int, default=135_000, help="stop at this many continuation tokens")
    ap.add_argument("--mix", default="gsm8k=0.6,sharegpt=0.25,code=0.15")
    ap.add_argument("--sample-frac", type=float, default=0.25, help="share of prompts sampled instead of greedy")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=224)
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much wall time (resumable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--save-prompts", metavar="FILE", help="write the decontaminated prompts (.json.gz) and exit")
    ap.add_argument("--prompts", metavar="FILE", help="read prompts from --save-prompts output instead of the sources")
    a = ap.parse_args(argv)

    mix = {k: float(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}
    if a.save_prompts:  # same seed and order as a normal run, so record keys stay comparable across machines
        D.save_prompts(D.load_prompts(list(mix), seed=a.seed), a.save_prompts)
        print(f"prompts written to {a.save_prompts}")
        return
    torch.set_num_threads(a.threads)
    if a.target is None:
        from jetflow_sglang.paths import default_paths
        a.target = default_paths()[0]
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    prompts = D.read_prompts(a.prompts) if a.prompts else D.load_prompts(list(mix), seed=a.seed)
    print(json.dumps({s: len(p) for s, p in prompts.items()}), "prompts after decontamination", flush=True)
    t0 = time.time()
    recs = D.regenerate(model, tok, prompts, a.out, a.tokens, mix=mix, sample_frac=a.sample_frac,
                        temperature=a.temperature, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                        max_prompt_tokens=a.max_prompt_tokens, seed=a.seed,
                        time_limit=a.minutes * 60 if a.minutes else None)
    n = sum(len(r["ids"]) - r["prompt_len"] for r in recs)
    print(f"{len(recs)} sequences, {n} continuation tokens in {a.out} ({time.time() - t0:.0f} s this run)")


if __name__ == "__main__":
    main()
