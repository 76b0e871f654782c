"""A small CPU ablation of the head-training hyper-parameters, run before spending GPU time.

    python -m jetflow_sglang.train.ablate --out runs/ablate --sequences 120 --steps 120

Data: GSM8K *train* questions with their reference answers, teacher-forced through the target (chat template
applied; the teacher is still the target's distribution at every position, but the text is not the target's own).
This needs no generation, which a loaded 2-core CPU cannot afford. Every arm trains the causal head from the same
init on the same batches (same seed) for a fixed number of steps, then the held-out proxies are measured
(trainer.evaluate: depth-1 agreement, tau_w8, tau_chain). Arms differ from the base in one setting each.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from jetflow_sglang.train import data as D
from jetflow_sglang.train.features import build_cache
from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, evaluate, make_head, train

BASE = {"lr": 1e-3, "cosine": True, "gamma": 0.0, "layers": 2, "vocab": 16384, "branch_prob": 0.3, "seed": 0}
ARMS = {
    "base": {},
    "base-seed1": {"seed": 1},  # the same settings, another init and batch order: the noise floor
    "lr3e-4": {"lr": 3e-4},
    "lr3e-3": {"lr": 3e-3},
    "constant-lr": {"cosine": False},
    "gamma7": {"gamma": 7.0},
    "layers3": {"layers": 3},
    "vocab32k": {"vocab": 32768},
    "branch0": {"branch_prob": 0.0},
    "branch0.6": {"branch_prob": 0.6},
}


SHARED_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"


def gsm8k_records(tokenizer, n: int, eos_id: int, path: Path = SHARED_GSM8K) -> list[dict]:
    import json as _json

    recs = []
    if not Path(path).exists():
        raise FileNotFoundError(f"GSM8K train with answers not found at {path} (--gsm8k FILE)")
    with open(path) as f:
        for i, line in enumerate(f):
            if len(recs) >= n:
                break
            r = _json.loads(line)
            if "answer" not in r:
                raise ValueError(f"{path} has no answers; the ablation needs question + answer records")
            p = D.chat_ids(tokenizer, r["question"])
            a = tokenizer(r["answer"], add_special_tokens=False).input_ids + [eos_id]
            recs.append({"key": f"gsm8k/{i}", "source": "gsm8k", "mode": "greedy", "prompt_len": len(p),
                         "ids": p + a})
    return recs


def run_arm(name: str, over: dict, model, items, evals, all_recs, steps: int, seqs: int, blocks: int,
            out: Path) -> dict:
    s = {**BASE, **over}
    vocab = draft_vocab(all_recs, s["vocab"], model.config.vocab_size)
    torch.manual_seed(s["seed"])
    head = make_head(model, True, vocab, s["layers"])
    cfg = TrainConfig(lr=s["lr"], gamma=s["gamma"], branch_prob=s["branch_prob"], steps=steps, seqs=seqs,
                      blocks=blocks, warmup=max(steps // 12, 1), eval_every=10 ** 9, ckpt_every=10 ** 9,
                      log_every=steps, seed=s["seed"], schedule="cosine" if s["cosine"] else "constant")
    t0 = time.time()
    train({"causal": head}, model, items, [], cfg, out / name, progress=False)
    train_s = time.time() - t0
    lm_w = model.get_output_embeddings().weight.detach()[vocab].contiguous()
    vmap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vmap[vocab] = torch.arange(len(vocab))
    ev = evaluate(head, evals, lm_w, vmap, cfg, torch.device("cpu"))
    return {"arm": name, **s, "steps": steps, "train_s": round(train_s, 1), **{k: round(v, 4) for k, v in ev.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--sequences", type=int, default=120, help="GSM8K train question+answer sequences")
    ap.add_argument("--held-out", type=int, default=20)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="teacher dtype; float32 on CPUs without native bf16 (AVX2) is several times faster")
    ap.add_argument("--gsm8k", default=str(SHARED_GSM8K), help="GSM8K train jsonl with question and answer")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    if any(x not in ARMS for x in arms):
        ap.error(f"--arms takes a subset of {','.join(ARMS)}")
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.target is None:
        from jetflow_sglang.paths import default_paths
        a.target = default_paths()[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=getattr(torch, a.dtype)).eval().requires_grad_(False)
    recs = gsm8k_records(tok, a.sequences + a.held_out, tok.eos_token_id, Path(a.gsm8k))
    tap_layers = make_head(model, True, torch.arange(8)).config.tap_layers
    t0 = time.time()
    items = build_cache(model, recs, tap_layers, out / "features")
    print(f"[ablate] features for {len(recs)} sequences in {time.time() - t0:.0f} s", flush=True)
    train_items, evals = items[:a.sequences], items[a.sequences:]
    results_path = out / "results.jsonl"
    done = {json.loads(x)["arm"] for x in open(results_path)} if results_path.exists() else set()
    for name in arms:
        if name in done:
            continue
        r = run_arm(name, ARMS[name], model, train_items, evals, recs[:a.sequences], a.steps, a.seqs, a.blocks, out)
        print(json.dumps(r), flush=True)
        with open(results_path, "a") as f:
            f.write(json.dumps(r) + "\n")
    table = markdown([json.loads(x) for x in open(results_path)])
    (out / "results.md").write_text(table)
    print(table)


def markdown(rows: list[dict]) -> str:
    """The arms as a table, each against the base arm; the second seed's row is the noise floor to read them by."""
    base = next((r for r in rows if r["arm"] == "base"), None)
    lines = ["| arm | changed | held-out KL | acc1 | tau_w8 | tau_chain | d KL vs base | d tau_w8 vs base | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        changed = ", ".join(f"{k}={v}" for k, v in ARMS.get(r["arm"], {}).items()) or "-"
        d_kl = f"{r['eval_kl'] - base['eval_kl']:+.3f}" if base else ""
        d_tau = f"{r['tau_w8'] - base['tau_w8']:+.3f}" if base else ""
        lines.append(f"| {r['arm']} | {changed} | {r['eval_kl']:.3f} | {r['eval_acc1']:.3f} | {r['tau_w8']:.3f} | "
                     f"{r['tau_chain']:.3f} | {d_kl} | {d_tau} | {r['train_s']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
