"""`jetflow generate` and `jetflow paths`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .drafters import DRAFTERS, make_drafter
from .head import CheckpointError, HeadMismatchError, load_head
from .paths import DEFAULT_HEAD_DIR, default_paths
from .budget import parse_budget


def bidir_dir(head_dir) -> Path:
    return Path(str(head_dir).rstrip("/") + "-bidir")


def load_stack(target_dir=None, head_dir=None, dtype="bfloat16", drafter="jetflow", width=8, device="cpu"):
    """Target + drafter ready to generate. Heads are loaded only for drafters that use them."""
    from .target import Target

    target_dir = target_dir or default_paths()[0]
    target = Target.from_pretrained(target_dir, dtype=dtype, device=device)
    head = bidir = None
    if drafter not in ("ngram", "ar"):
        head_dir = Path(head_dir or DEFAULT_HEAD_DIR)
        wanted = head_dir if drafter.startswith("jetflow") else bidir_dir(head_dir)
        if not wanted.exists() and drafter in ("ddtree", "dflash") and (head_dir / "config.json").exists():
            wanted = head_dir  # no bidirectional head next to it: the baselines run on the given head
        loaded = load_head(wanted, target)
        if loaded.config.tap_layers != target.tap_layers:
            target.tap_layers = list(loaded.config.tap_layers)
        head, bidir = (loaded, None) if drafter.startswith("jetflow") else (None, loaded)
    return target, make_drafter(drafter, head, bidir, width=width)


def cmd_generate(a) -> int:
    import torch

    from .engine import autoregressive, generate, Result

    from .verify import check_sampling

    parse_budget(a.budget)
    check_sampling(a.temperature, a.top_k, a.top_p)
    if not a.prompt.strip():
        raise ValueError("the prompt is empty")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}, but this torch ({torch.__version__}) sees no CUDA device")
    target, drafter = load_stack(a.target, a.head, a.dtype, a.drafter, a.width, a.device)
    ids = target.encode_chat(a.prompt) if not a.raw else target.tokenizer.encode(a.prompt)
    target.check_prompt(ids)
    eos = target.eos_ids()
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, eos_ids=eos, seed=a.seed)
    out = sys.stderr if a.json else sys.stdout
    ar = None
    if a.compare_ar:
        autoregressive(target, ids, **{**kw, "max_new_tokens": 2})  # warm-up, so both runs start hot
        ar = autoregressive(target, ids, **kw)
    res = Result(list(ids), [])
    import time
    t0, shown = time.perf_counter(), ""
    for rnd in generate(target, drafter, ids, budget=a.budget, **kw):
        res.rounds.append(rnd)
        res.tokens.extend(rnd.new_tokens)
        text = target.tokenizer.decode(res.tokens, skip_special_tokens=True)
        if text.startswith(shown):  # stream only what is new (decoding can revise a partial character)
            out.write(text[len(shown):])
            out.flush()
            shown = text
    res.elapsed_s = time.perf_counter() - t0
    text = target.tokenizer.decode(res.tokens, skip_special_tokens=True)
    summary = {
        "text": text, "tokens": res.tokens, "drafter": drafter.name, "budget": a.budget, "dtype": a.dtype,
        "temperature": a.temperature, "new_tokens": len(res.tokens), "verify_steps": res.steps,
        "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 3),
        "ar_tokens_per_s": round(ar.tokens_per_s, 3) if ar else None,
        "speedup_vs_ar": round(res.tokens_per_s / ar.tokens_per_s, 4) if ar and ar.tokens_per_s else None,
        "lossless": (res.tokens == ar.tokens) if ar and a.temperature == 0 else None,
    }
    out.write("\n")
    stats = f"[jetflow] {drafter.name} budget={a.budget}: {len(res.tokens)} tokens, tau={res.tau:.2f}, {res.tokens_per_s:.1f} tok/s"
    if ar:
        stats += f", AR {ar.tokens_per_s:.1f} tok/s, speedup {summary['speedup_vs_ar']:.2f}x"
        if summary["lossless"] is not None:
            stats += f", identical to AR: {summary['lossless']}"
    print(stats, file=sys.stderr)
    if a.json:
        print(json.dumps(summary))
    return 0


def cmd_paths(a) -> int:
    target_dir, head_dir = default_paths()
    print(f"target: {target_dir}\nhead:   {head_dir}\nbidirectional head: {bidir_dir(head_dir)}")
    return 0


def budget_arg(s: str):
    try:
        return parse_budget(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetflow", description="JetFlow speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt")
    g.add_argument("--budget", type=budget_arg, default=16, help="tree nodes per verify step, root included (1-512), or 'auto' to adapt it online")
    g.add_argument("--drafter", choices=DRAFTERS, default="jetflow")
    g.add_argument("--width", type=int, default=8, help="candidates per depth / per parent")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="bfloat16 (default): ~1.5x faster on CPU, but a batched verify may round a near-tie differently "
                        "from a one-token step; float32: greedy output bit-identical to autoregressive decoding")
    g.add_argument("--target", help="HF model folder (default: SmolLM2-135M-Instruct, converted on first use)")
    g.add_argument("--head", help=f"draft head folder (default: {DEFAULT_HEAD_DIR})")
    g.add_argument("--compare-ar", action="store_true", help="also decode autoregressively and report speedup and losslessness")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end (text streams to stderr)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (CUDA verifies trees with the Triton tree kernel)")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    g.set_defaults(fn=cmd_generate)
    pa = sub.add_parser("paths", help="print (and prepare) the default target and head folders")
    pa.set_defaults(fn=cmd_paths)
    return p


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a = parser().parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, CheckpointError, HeadMismatchError, OSError) as e:
        print(f"jetflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
