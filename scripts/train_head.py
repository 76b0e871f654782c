#!/usr/bin/env python
"""Train JetFlow draft heads by block distillation on target-regenerated data (see docs/TRAINING.md).

    python scripts/regenerate.py --out runs/regen/smollm2.jsonl --minutes 30
    python scripts/train_head.py --data runs/regen/smollm2.jsonl --run runs/train/smollm2 --minutes 60

trains the causal head (the default; also used by jetflow-branch) and the bidirectional head (ddtree/dflash) in one
process on identical batches, and exports them into jetflow_sglang/heads/. Rerunning the same command resumes.
On a GPU add `--device cuda` (and raise --seqs / --minutes as the budget allows).
"""
import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from jetflow_sglang.paths import DEFAULT_HEAD_DIR
from jetflow_sglang.train import data as D
from jetflow_sglang.train.features import build_cache
from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, export, make_head, train


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF folder of the target (default: the packaged SmolLM2)")
    ap.add_argument("--data", nargs="+", required=True, help="regeneration jsonl file(s) from scripts/regenerate.py")
    ap.add_argument("--run", required=True, help="run folder: feature cache, checkpoint, log.jsonl, summary.json")
    ap.add_argument("--heads", default="causal,bidir", help="which heads to train together: causal, bidir or both")
    ap.add_argument("--out-causal", default=str(DEFAULT_HEAD_DIR))
    ap.add_argument("--out-bidir", default=str(DEFAULT_HEAD_DIR) + "-bidir")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--taps", type=int, default=4, help="tapped target layers")
    ap.add_argument("--vocab", type=int, default=16384, help="reduced draft vocabulary (0 = full)")
    ap.add_argument("--loss", default="fkl", choices=["fkl", "rkl", "sft"])
    ap.add_argument("--gamma", type=float, default=0.0, help="depth weighting exp(-(d-1)/gamma); 0 = uniform")
    ap.add_argument("--branch-prob", type=float, default=0.3, help="share of branch-conditioned blocks (causal head)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seqs", type=int, default=4, help="sequences per step")
    ap.add_argument("--blocks", type=int, default=16, help="anchor blocks per sequence")
    ap.add_argument("--minutes", type=float, default=60.0, help="training wall time (all heads together); 0 = --steps")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-frac", type=float, default=0.03, help="share of greedy sequences held out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-export", action="store_true")
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    kinds = [k for k in a.heads.split(",") if k]
    if not kinds or any(k not in ("causal", "bidir") for k in kinds):
        ap.error("--heads takes causal, bidir or causal,bidir")
    if a.target is None:
        from jetflow_sglang.paths import default_paths
        a.target = default_paths()[0]
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).to(a.device).eval()
    model.requires_grad_(False)

    recs = [r for path in a.data for r in D.read_records(path)]
    if not recs:
        sys.exit(f"no records in {a.data}; run scripts/regenerate.py first")
    held = lambda r: r["mode"] == "greedy" and zlib.crc32(r["key"].encode()) % 1000 < a.eval_frac * 1000  # noqa: E731
    n_taps_layers = make_head(model, True, torch.arange(8), a.layers, a.taps).config.tap_layers
    items = build_cache(model, recs, n_taps_layers, run / "features")
    if a.device != "cpu":  # batches are then assembled on the device: no host copy of the taps per step
        for it in items:
            it["taps"], it["final"] = it["taps"].to(a.device), it["final"].to(a.device)
    train_items = [it for r, it in zip(recs, items) if not held(r)]
    eval_items = [it for r, it in zip(recs, items) if held(r)]
    n_cont = sum(len(it["ids"]) - it["prompt_len"] for it in train_items)
    print(f"[train] {len(train_items)} training sequences ({n_cont} continuation tokens), {len(eval_items)} held out; "
          f"features ready after {time.time() - t0:.0f} s", flush=True)

    vocab = draft_vocab(train_items, a.vocab, model.config.vocab_size)
    ev_tokens = [t for it in eval_items for t in it["ids"][it["prompt_len"]:].tolist()]
    vset = set(vocab.tolist())
    coverage = sum(t in vset for t in ev_tokens) / max(len(ev_tokens), 1)
    heads = {k: make_head(model, k == "causal", vocab, a.layers, a.taps) for k in kinds}
    cfg = TrainConfig(loss=a.loss, gamma=a.gamma, lr=a.lr, seqs=a.seqs, blocks=a.blocks, branch_prob=a.branch_prob,
                      steps=a.steps, minutes=a.minutes, eval_every=a.eval_every, ckpt_every=a.eval_every,
                      seed=a.seed, device=a.device)
    t1 = time.time()
    history = train(heads, model, train_items, eval_items, cfg, run)
    train_s = time.time() - t1
    step = torch.load(run / "ckpt.pt", weights_only=False)["step"]
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else list(argv)))
    minutes = history[kinds[0]][-1]["min"] if history[kinds[0]] else None
    summary = {"command": command,
               "target": str(a.target), "data": a.data, "train_sequences": len(train_items),
               "train_continuation_tokens": n_cont, "eval_sequences": len(eval_items),
               "draft_vocab": len(vocab), "eval_vocab_coverage": round(coverage, 4), "steps": step,
               "train_wall_s_this_run": round(train_s), "train_minutes_total": minutes,
               "loss": a.loss, "gamma": a.gamma, "branch_prob": a.branch_prob, "device": a.device,
               "final_eval": {k: history[k][-1] for k in kinds if history[k]}}
    (run / "summary.json").write_text(json.dumps({**summary, "history": history}, indent=2))
    print(json.dumps(summary, indent=2))
    if not a.no_export:
        for k, h in heads.items():
            out = export(h, a.out_causal if k == "causal" else a.out_bidir, summary | {"head": k})
            print(f"[train] {k} head -> {out}")


if __name__ == "__main__":
    main()
