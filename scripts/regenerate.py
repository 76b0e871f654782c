#!/usr/bin/env python
"""Regenerate draft-head training data: the target continues training prompts with its own chat template.

    python scripts/regenerate.py --out runs/regen/smollm2.jsonl --tokens 135000
    python scripts/regenerate.py --engine sglang --device cuda --batch-size 1024 --out runs/regen/x.jsonl --target DIR

Resumable: rerun the same command and it continues where it stopped. `--engine sglang` runs the target in SGLang's
offline `sglang.Engine` (continuous batching; on CPU it needs JETFLOW_SGLANG_CPU=1, see docs/SERVING.md); `--engine hf`
(the default) uses HF `generate`. Both write the same records. See docs/TRAINING.md.
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jetflow_sglang.train import data as D
from jetflow_sglang.train.engines import ENGINES, SGLangContinuer


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
    ap.add_argument("--until", type=float, default=None, help="unix time: start no batch after it (a timed plan)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", default="hf", choices=ENGINES, help="hf: transformers generate; sglang: sglang.Engine")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="sglang: KV pool size in tokens (bound it on CPU)")
    ap.add_argument("--max-running-requests", type=int, default=None, help="sglang: decode batch size")
    ap.add_argument("--mem-fraction", type=float, default=None, help="sglang: mem_fraction_static on a GPU")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--shard", default="0/1", help="i/n: only prompts i mod n (for parallel workers, one --out each)")
    ap.add_argument("--skip", nargs="*", default=[], metavar="JSONL", help="records in these files count as done")
    ap.add_argument("--save-prompts", metavar="FILE", help="write the decontaminated prompts (.json.gz) and exit")
    ap.add_argument("--prompts", metavar="FILE", help="read prompts from --save-prompts output instead of the sources")
    a = ap.parse_args(argv)

    try:
        mix = {k: float(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}
        shard = tuple(int(x) for x in a.shard.split("/"))
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ValueError
    except ValueError:
        ap.error("--mix takes source=weight,... and --shard takes i/n with 0 <= i < n")
    if a.save_prompts:  # same seed and order as a normal run, so record keys stay comparable across machines
        D.save_prompts(D.load_prompts(list(mix), seed=a.seed), a.save_prompts)
        print(f"prompts written to {a.save_prompts}")
        return
    torch.set_num_threads(a.threads)
    if a.target is None:
        from jetflow_sglang.paths import default_paths
        a.target = default_paths()[0]
    tok = AutoTokenizer.from_pretrained(a.target)
    prompts = D.read_prompts(a.prompts) if a.prompts else D.load_prompts(list(mix), seed=a.seed)
    print(json.dumps({s: len(p) for s, p in prompts.items()}), "prompts after decontamination", flush=True)
    t0 = time.time()
    limits = ([a.minutes * 60] if a.minutes else []) + ([a.until - t0] if a.until is not None else [])
    kw = dict(mix=mix, sample_frac=a.sample_frac, temperature=a.temperature, batch_size=a.batch_size,
              max_new_tokens=a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens, seed=a.seed,
              time_limit=max(min(limits), 0.0) if limits else None, shard=shard,
              skip_keys={r["key"] for path in a.skip for r in D.read_records(path)})
    if a.engine == "sglang":
        try:
            engine = SGLangContinuer(str(a.target), tok, device=a.device, dtype=a.dtype, seed=a.seed,
                                     max_total_tokens=a.max_total_tokens, max_running_requests=a.max_running_requests,
                                     mem_fraction_static=a.mem_fraction)
        except RuntimeError as e:
            sys.exit(f"regenerate.py: {e}")
        with engine:
            recs = D.regenerate(engine, tok, prompts, a.out, a.tokens, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.target, dtype=getattr(torch, a.dtype)).to(a.device).eval()
        recs = D.regenerate(model, tok, prompts, a.out, a.tokens, **kw)
    n = sum(len(r["ids"]) - r["prompt_len"] for r in recs)
    print(f"{len(recs)} sequences, {n} continuation tokens in {a.out} ({time.time() - t0:.0f} s this run)")


if __name__ == "__main__":
    main()
