#!/usr/bin/env python
"""Offline vs online teacher throughput on this machine (docs/TRAINING.md, "Online teacher").

    python scripts/bench_teacher.py --tiny --steps 20                       # a tiny random Qwen3, random records
    python scripts/bench_teacher.py --data runs/regen/smollm2.jsonl.gz      # the default SmolLM2-135M, real records

Both paths train the causal and the bidirectional head for --steps steps on the same records with the same settings
(target in bf16, bf16 autocast, no evaluation). Reported: the offline feature build in sequence tokens/s (once per
record, before training), and each path's training steps in block tokens/s (seqs x blocks x block size per step:
what the heads train on), the online figure including the target forward inside every step.
"""
import argparse
import gzip
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch


def tiny_qwen3(vocab: int = 512):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def random_records(n: int, vocab: int, prompt: int = 64, cont: int = 192):
    g = torch.Generator().manual_seed(0)
    return [{"key": f"r/{i}", "source": "r", "mode": "greedy", "prompt_len": prompt,
             "ids": torch.randint(2, vocab, (prompt + cont,), generator=g).tolist()} for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 and random records instead of --target")
    ap.add_argument("--target", default=None, help="HF folder (default: the packaged SmolLM2-135M)")
    ap.add_argument("--data", default=None, help="regeneration JSONL (.gz too); its first --records records are used")
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--taps", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM

    from jetflow_sglang.train.features import build_cache
    from jetflow_sglang.train.online import OnlineSampler, OnlineTeacher
    from jetflow_sglang.train.stream import RecordStream
    from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, make_head, train

    if a.tiny:
        model = tiny_qwen3()
        recs = random_records(a.records, model.config.vocab_size)
    else:
        if a.target is None:
            from jetflow_sglang.paths import default_paths
            a.target = default_paths()[0]
        model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).eval()
        opener = gzip.open if a.data.endswith(".gz") else open
        with opener(a.data, "rt") as f:
            recs = [json.loads(line) for line in itertools.islice(f, a.records)]
    model.requires_grad_(False)
    vocab = draft_vocab(recs, a.vocab, model.config.vocab_size)
    cfg = TrainConfig(steps=a.steps, seqs=a.seqs, blocks=a.blocks, eval_every=10**9, ckpt_every=10**9, seed=0)
    block_tokens = a.steps * a.seqs * a.blocks * 16
    out = {"target": "tiny random Qwen3 (d 128, 6 layers)" if a.tiny else str(a.target), "records": len(recs),
           "seq_tokens": sum(len(r["ids"]) for r in recs), "steps": a.steps, "seqs": a.seqs, "blocks": a.blocks,
           "threads": a.threads}

    def heads():
        torch.manual_seed(0)
        return {k: make_head(model, k == "causal", vocab, a.layers, a.taps) for k in ("causal", "bidir")}

    tap_layers = heads()["causal"].config.tap_layers
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        items = build_cache(model, recs, tap_layers, None)
        feat_s = time.time() - t
        out["offline_feature_tok_s"] = round(out["seq_tokens"] / feat_s)
        train(heads(), model, items, [], cfg, Path(tmp) / "off")
        off_s = torch.load(Path(tmp) / "off" / "ckpt.pt", weights_only=False)["elapsed"]
        out["offline_train_block_tok_s"] = round(block_tokens / off_s)

        with open(Path(tmp) / "d.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        teacher = OnlineTeacher(model, tap_layers)
        sampler = OnlineSampler(RecordStream([Path(tmp) / "d.jsonl"], seed=0), teacher, cfg, 16)
        train(heads(), model, [], [], cfg, Path(tmp) / "on", sampler=sampler, data_state=sampler, teacher=teacher)
        on_s = torch.load(Path(tmp) / "on" / "ckpt.pt", weights_only=False)["elapsed"]
        out["online_train_block_tok_s"] = round(block_tokens / on_s)
        out["online_teacher_seq_tok_per_step"] = round(teacher.tokens / a.steps)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
