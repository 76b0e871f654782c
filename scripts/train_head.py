#!/usr/bin/env python
"""Train JetFlow draft heads by block distillation on target-regenerated data (see docs/TRAINING.md).

    python scripts/regenerate.py --out runs/regen/smollm2.jsonl --minutes 30
    python scripts/train_head.py --data runs/regen/smollm2.jsonl --run runs/train/smollm2 --minutes 60

trains the causal head (the default; also used by jetflow-branch) and the bidirectional head (ddtree/dflash) in one
process on identical batches, and exports them into jetflow_sglang/heads/. Rerunning the same command resumes.
On a GPU add `--device cuda` (and raise --seqs / --minutes as the budget allows).

Data-parallel (DDP; gloo on CPU, nccl on CUDA): `torchrun --nproc-per-node N scripts/train_head.py ...` with the same
arguments. Each rank builds and holds only its shard of the teacher features and draws --seqs sequences per step
(global batch = N x --seqs); only rank 0 evaluates, logs, checkpoints and exports. A run resumes with any N.

`--teacher online` caches nothing: the frozen target runs inside every step, and --data streams as it is consumed
(rank r takes every N-th record of each step's N x --seqs; the position is in the checkpoint).
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
from jetflow_sglang.train import dist
from jetflow_sglang.train import online
from jetflow_sglang.train.stream import RecordStream
from jetflow_sglang.train.features import build_cache
from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, export, make_head, train


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF folder of the target (default: the packaged SmolLM2)")
    ap.add_argument("--data", nargs="+", required=True, help="regeneration jsonl file(s) from scripts/regenerate.py")
    ap.add_argument("--run-dir", "--run", dest="run", required=True,
                    help="run folder: feature cache, checkpoint, log.jsonl, summary.json (under torchrun spell it "
                         "--run-dir: torchrun's own parser takes --run for its --run-path)")
    ap.add_argument("--heads", default="causal,bidir", help="which heads to train together: causal, bidir or both")
    ap.add_argument("--out-causal", default=str(DEFAULT_HEAD_DIR))
    ap.add_argument("--out-bidir", default=str(DEFAULT_HEAD_DIR) + "-bidir")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--taps", type=int, default=4, help="tapped target layers")
    ap.add_argument("--vocab", type=int, default=None,
                    help="reduced draft vocabulary (0 = full; default 16384, and 0 with --release-layout)")
    ap.add_argument("--release-layout", action="store_true",
                    help="train heads that `jetflow export-head` writes exactly in the JetSpec/DFlash release layout: "
                         "q/k norms, full vocabulary, mask slots embed --mask-token-id with the target's embedding")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="with --release-layout: the mask token (default: the first embedding row past the "
                         "tokenizer, else its unk, pad or eos token)")
    ap.add_argument("--loss", default="fkl", choices=["fkl", "rkl", "sft"])
    ap.add_argument("--gamma", type=float, default=0.0, help="depth weighting exp(-(d-1)/gamma); 0 = uniform")
    ap.add_argument("--branch-prob", type=float, default=0.3, help="share of branch-conditioned blocks (causal head)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seqs", type=int, default=4, help="sequences per step (per rank under torchrun)")
    ap.add_argument("--blocks", type=int, default=16, help="anchor blocks per sequence")
    ap.add_argument("--minutes", type=float, default=60.0, help="training wall time (all heads together); 0 = --steps")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--teacher", default="offline", choices=["offline", "online"],
                    help="offline: cache the target's features of all records first (RUN/features); online: run the "
                         "frozen target inside every step and stream --data as it is consumed (no cache; see "
                         "docs/TRAINING.md, 'Online teacher')")
    ap.add_argument("--stream-window", type=int, default=4096,
                    help="--teacher online: records shuffled together as the files stream (bounds the memory)")
    ap.add_argument("--online-eval-seqs", type=int, default=256,
                    help="--teacher online: held-out sequences evaluated (the target runs on them at every eval)")
    ap.add_argument("--no-feature-files", action="store_true",
                    help="keep the teacher features in memory only (no RUN/features; recomputed on a rerun)")
    ap.add_argument("--until", type=float, default=None,
                    help="unix time by which training must end (its minutes are what is left after the features)")
    ap.add_argument("--export-every-ckpt", action="store_true",
                    help="export the heads at every checkpoint too, so a run cut short still leaves heads")
    ap.add_argument("--ckpt-minutes", type=float, default=0.0, help="also checkpoint every this many training minutes")
    ap.add_argument("--eval-frac", type=float, default=0.03, help="share of greedy sequences held out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-export", action="store_true")
    a = ap.parse_args(argv)

    if a.release_layout and a.vocab not in (None, 0):
        ap.error("--release-layout drafts over the full vocabulary: drop --vocab or pass --vocab 0")
    if a.mask_token_id is not None and not a.release_layout:
        ap.error("--mask-token-id needs --release-layout (other heads learn their mask vector)")
    a.vocab = (0 if a.release_layout else 16384) if a.vocab is None else a.vocab
    torch.set_num_threads(a.threads)
    kinds = [k for k in a.heads.split(",") if k]
    if not kinds or any(k not in ("causal", "bidir") for k in kinds):
        ap.error("--heads takes causal, bidir or causal,bidir")
    info = dist.DistInfo.from_env()
    device = info.device(a.device)
    if a.target is None:
        from jetflow_sglang.paths import default_paths
        a.target = default_paths()[0]
    if a.teacher == "online":  # streamed: the files are read as training consumes them (train/stream.py)
        recs = None
    else:
        recs = [r for path in a.data for r in D.read_records(path)]
        if not recs:
            sys.exit(f"no records in {a.data}; run scripts/regenerate.py first")
        if len(recs) < info.world:
            sys.exit(f"{len(recs)} records cannot feed {info.world} ranks")
    dist.init(info, device)
    try:
        run_training(a, kinds, info, device, recs, argv)
    finally:
        dist.shutdown()


def run_training(a, kinds, info, device, recs, argv):
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).to(device).eval()
    model.requires_grad_(False)
    held = lambda r: r["mode"] == "greedy" and zlib.crc32(r["key"].encode()) % 1000 < a.eval_frac * 1000  # noqa: E731
    tap_layers = make_head(model, True, torch.arange(8), a.layers, a.taps).config.tap_layers
    if a.teacher == "online":  # one streaming pass for the vocabulary and counts; no features
        sc = online.scan(a.data, held, model.config.vocab_size, a.vocab, a.online_eval_seqs, progress=info.main)
        vocab, coverage, n_train, n_cont, n_eval = sc.vocab, sc.coverage, sc.n_train, sc.n_cont, sc.n_eval
        train_items, eval_items = [], sc.eval_rows if info.main else []
    else:
        train_recs = [r for r in recs if not held(r)]
        eval_recs = [r for r in recs if held(r)]
        n_train, n_eval = len(train_recs), len(eval_recs)
        mine = dist.shard(train_recs, info.rank, info.world) + (eval_recs if info.main else [])
        items = build_cache(model, mine, tap_layers, None if a.no_feature_files else run / "features",
                            progress=info.main, tag=f"r{info.rank}" if info.distributed else "")
        if device != "cpu":  # batches are then assembled on the device: no host copy of the taps per step
            for it in items:
                it["taps"], it["final"] = it["taps"].to(device), it["final"].to(device)
        eval_keys = {r["key"] for r in eval_recs}
        train_items = [it for it in items if it["key"] not in eval_keys]
        eval_items = [it for it in items if it["key"] in eval_keys]
        n_cont = sum(len(r["ids"]) - r["prompt_len"] for r in train_recs)
        vocab = draft_vocab(train_recs, a.vocab, model.config.vocab_size)  # from the records: identical on every rank
        ev_tokens = [t for r in eval_recs for t in r["ids"][r["prompt_len"]:]]
        vset = set(vocab.tolist())
        coverage = sum(t in vset for t in ev_tokens) / max(len(ev_tokens), 1)
    if info.main:
        print(f"[train] {n_train} training sequences ({n_cont} continuation tokens) over {info.world} rank(s), "
              f"{n_eval} held out; {a.teacher} teacher, data ready after {time.time() - t0:.0f} s", flush=True)
    mask_id, release = release_mask(a, model) if a.release_layout else (None, {})
    heads = {k: make_head(model, k == "causal", vocab, a.layers, a.taps, mask_token_id=mask_id) for k in kinds}
    cfg = TrainConfig(loss=a.loss, gamma=a.gamma, lr=a.lr, seqs=a.seqs, blocks=a.blocks, branch_prob=a.branch_prob,
                      steps=a.steps, minutes=a.minutes, eval_every=a.eval_every, ckpt_every=a.eval_every,
                      log_every=a.log_every,
                      ckpt_minutes=a.ckpt_minutes, seed=a.seed, device=device)
    if a.until is not None:  # the time left after loading and features, less a reserve for the final eval and export
        done = torch.load(run / "ckpt.pt", weights_only=False)["elapsed"] / 60 if (run / "ckpt.pt").exists() else 0.0
        cfg.minutes = done + max((a.until - time.time() - 20) / 60, 0.1)
        cfg.steps = max(cfg.steps, 1)
        if info.main:
            print(f"[train] {cfg.minutes:.2f} training minutes left before --until", flush=True)
    provenance = {"command": " ".join(sys.argv), "target": str(a.target), "train_sequences": n_train,
                  "train_continuation_tokens": n_cont, "draft_vocab": len(vocab), "world_size": info.world, **release}

    def export_now(step, hs):
        for k, h in hs.items():
            export(h, a.out_causal if k == "causal" else a.out_bidir, provenance | {"head": k, "steps": step,
                                                                                  "partial": True})
        print(f"[train] step {step}: checkpoint and heads exported", flush=True)

    teacher = sampler = None
    if a.teacher == "online":  # the target inside every step; the stream position goes into the checkpoint
        teacher = online.OnlineTeacher(model, tap_layers)
        stream = RecordStream(a.data, keep=lambda r: not held(r), window=a.stream_window, seed=a.seed)
        sampler = online.OnlineSampler(stream, teacher, cfg, heads[kinds[0]].config.block_size, info.rank, info.world)
    t1 = time.time()
    history = train(heads, model, train_items, eval_items, cfg, run, info=info,
                    on_ckpt=export_now if a.export_every_ckpt and not a.no_export else None,
                    sampler=sampler, teacher=teacher, data_state=sampler)
    if not info.main:
        return
    train_s = time.time() - t1
    step = torch.load(run / "ckpt.pt", weights_only=False)["step"]
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else list(argv)))
    if info.distributed:
        command = f"torchrun --nproc-per-node {info.world} " + command[len("python "):]
    minutes = history[kinds[0]][-1]["min"] if history[kinds[0]] else None
    summary = {"command": command,
               "target": str(a.target), "data": a.data, "train_sequences": n_train,
               "train_continuation_tokens": n_cont, "eval_sequences": n_eval, "world_size": info.world,
               "global_batch_sequences": a.seqs * info.world, "teacher": a.teacher,
               "draft_vocab": len(vocab), "eval_vocab_coverage": round(coverage, 4), "steps": step,
               "train_wall_s_this_run": round(train_s), "train_minutes_total": minutes,
               "loss": a.loss, "gamma": a.gamma, "branch_prob": a.branch_prob, "lr": a.lr, "layers": a.layers,
               "device": a.device, "final_eval": {k: history[k][-1] for k in kinds if history[k]}, **release}
    (run / "summary.json").write_text(json.dumps({**summary, "history": history}, indent=2))
    print(json.dumps(summary, indent=2))
    if not a.no_export:
        for k, h in heads.items():
            out = export(h, a.out_causal if k == "causal" else a.out_bidir, summary | {"head": k})
            print(f"[train] {k} head -> {out}")


def release_mask(a, model) -> tuple[int, dict]:
    """--release-layout: the mask token (given, or chosen by export.release_mask_token_id) and what to record."""
    from jetflow_sglang.head.export import release_mask_token_id

    if a.mask_token_id is not None:
        mask_id, rule = a.mask_token_id, "--mask-token-id"
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(a.target)
        except (OSError, ValueError) as e:
            sys.exit(f"--release-layout: cannot load the tokenizer of {a.target} to choose the mask token "
                     f"({' '.join(str(e).split())}); pass --mask-token-id")
        try:
            mask_id, rule = release_mask_token_id(tok, model.config.vocab_size)
        except ValueError as e:
            sys.exit(f"--release-layout: {e}")
    if not 0 <= mask_id < model.config.vocab_size:
        sys.exit(f"--mask-token-id {mask_id} is outside the target's vocabulary (0..{model.config.vocab_size - 1})")
    return mask_id, {"release_layout": True, "mask_token_rule": rule, "torch_dtype": "bfloat16"}  # export(): bf16


if __name__ == "__main__":
    main()
