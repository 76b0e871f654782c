"""`jetflow generate`, `jetflow paths` and `jetflow export-head`.

Bad input is one line on stderr and exit code 2. Everything that can be checked without a model (argument values,
the prompt's encoding, the device name, the head's config against the target's config) is checked before any
weights are read.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from jetflow_sglang.core.budget import MAX_BUDGET, parse_budget
from jetflow_sglang.head import CheckpointError, HeadMismatchError
from jetflow_sglang.paths import DEFAULT_HEAD_DIR, bidir_dir, default_paths
from jetflow_sglang.draft.registry import DEFAULT_WIDTH, DRAFTERS, TREES
from jetflow_sglang.engine.stack import check_device, load_stack

__all__ = ["bidir_dir", "load_stack", "main", "parser"]  # cli.load_stack: alias of stack.load_stack


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _typed(check):
    def parse(s: str):
        try:
            return check(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = check.__name__
    return parse


def _int(s: str, minimum: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise ValueError(f"must be an integer >= {minimum}; got {s!r}") from None
    if v < minimum:
        raise ValueError(f"must be an integer >= {minimum}; got {s!r}")
    return v


@_typed
def positive_int(s: str) -> int:
    return _int(s, 1)


@_typed
def nonneg_int(s: str) -> int:
    return _int(s, 0)


@_typed
def finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"must be a number; got {s!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number; got {s!r}")
    return v


@_typed
def budget_arg(s: str):
    try:
        return parse_budget(s)
    except ValueError:
        raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] or 'auto'; got {s!r}") from None


@_typed
def device_arg(s: str) -> str:
    return check_device(s)


def check_prompt_text(prompt: str) -> None:
    """The prompt must be non-empty UTF-8. Undecodable argv bytes reach Python as lone surrogates (PEP 383)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"code point U+{ord(bad):04X}"
        raise ValueError(f"the prompt is not valid UTF-8 ({byte} at character {e.start})") from None
    if not prompt.strip():
        raise ValueError("the prompt is empty")


def cmd_generate(a) -> int:
    import time

    import torch

    from jetflow_sglang.engine.loop import Result, autoregressive, generate
    from jetflow_sglang.core.verify import check_sampling

    check_prompt_text(a.prompt)
    check_sampling(a.temperature, a.top_k, a.top_p)
    if a.threads:
        torch.set_num_threads(a.threads)
    target, drafter = load_stack(a.target, a.head, a.dtype, a.drafter, a.width, a.device, tree=a.tree, depth=a.depth,
                                 lookup=a.lookup, exact=a.exact)
    runner = None
    base = getattr(drafter, "base", drafter)  # the head drafter under a WithLookup
    if a.graphs != "off" and hasattr(base, "runner"):  # the tree build replayed from its capture per shape
        from jetflow_sglang.core.graphs import GraphRunner, default_backend

        runner = base.runner = GraphRunner(default_backend(a.device), check=a.graphs == "check")
        base.paged = a.device.startswith("cuda")  # the head over a paged context (Triton), replayed too
    ids = target.encode_chat(a.prompt) if not a.raw else target.tokenizer.encode(a.prompt)
    target.check_prompt(ids)
    eos = target.eos_ids()
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, eos_ids=eos, seed=a.seed)
    out = sys.stderr if a.json else sys.stdout
    ar = None
    if a.compare_ar:
        autoregressive(target, ids, **{**kw, "max_new_tokens": 2})  # warm-up, so both runs start hot
        ar = autoregressive(target, ids, **kw)
    if a.budget == "auto":  # the verify-cost prior is measured once per machine (cached), like loading the model
        from jetflow_sglang.engine.profiling import measure_cost_prior

        measure_cost_prior(target)
    res = Result(list(ids), [])
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
    div = None
    if ar and a.temperature == 0 and res.tokens != ar.tokens:  # greedy runs should agree: show where and why not
        from jetflow_sglang.engine.diverge import first_divergence

        div = first_divergence(target, list(ids), res.tokens, ar.tokens)
    summary = {
        "text": text, "tokens": res.tokens, "drafter": base.name, "budget": a.budget, "dtype": str(target.dtype).removeprefix("torch."),
        "tree": a.tree, "depth": getattr(base, "depth", None), "exact_rows": target.exact,
        "lookup": hasattr(drafter, "lookup"),
        "temperature": a.temperature, "new_tokens": len(res.tokens), "verify_steps": res.steps,
        "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 3),
        "mean_budget": round(sum(len(r.tree) for r in res.rounds if r.tree) / max(1, res.steps), 2),
        "ar_tokens_per_s": round(ar.tokens_per_s, 3) if ar else None,
        "speedup_vs_ar": round(res.tokens_per_s / ar.tokens_per_s, 4) if ar and ar.tokens_per_s else None,
        "lossless": (res.tokens == ar.tokens) if ar and a.temperature == 0 else None,
        "divergence": div,
        "graphs": runner.snapshot() if runner else None,
    }
    out.write("\n")
    budget = f"auto (mean {summary['mean_budget']:.1f})" if a.budget == "auto" else a.budget
    rows = ", exact rows" if target.exact else ""
    stats = (f"[jetflow] {drafter.name} budget={budget} ({summary['dtype']}{rows}): {len(res.tokens)} tokens, "
             f"tau={res.tau:.2f}, {res.tokens_per_s:.1f} tok/s")
    if runner:
        g = runner.snapshot()
        stats += f", {g['replays']} replays of {g['captures']} {g['backend']} captures"
        stats += " (each equal to eager)" if a.graphs == "check" else ""
    if ar:
        stats += f", AR {ar.tokens_per_s:.1f} tok/s, speedup {summary['speedup_vs_ar']:.2f}x"
        if summary["lossless"]:
            stats += ", identical to AR: True"
    print(stats, file=sys.stderr)
    if div:
        from jetflow_sglang.engine.diverge import format_divergence

        print("[jetflow] " + format_divergence(div, target.tokenizer), file=sys.stderr)
    if a.json:
        print(json.dumps(summary))
    return 0


def cmd_paths(a) -> int:
    target_dir, head_dir = default_paths()
    print(f"target: {target_dir}\nhead:   {head_dir}\nbidirectional head: {bidir_dir(head_dir)}")
    return 0


def cmd_export_head(a) -> int:
    from jetflow_sglang.head.export import export_head

    out = export_head(a.head_dir, a.out_dir, a.format, a.target)
    print(f"[jetflow] {a.format} head -> {out}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="jetflow", description="JetFlow speculative decoding")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt")
    g.add_argument("--budget", type=budget_arg, default="auto",
                   help="tree nodes per verify step, root included (1-512), or 'auto' (default): adapt it online to "
                        "this machine's verify cost and the head's acceptance")
    g.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="default: from the head (causal: jetflow; bidirectional, e.g. a DFlash release: ddtree)")
    g.add_argument("--width", type=positive_int, default=DEFAULT_WIDTH, help="candidates per depth / per parent (>= 1)")
    g.add_argument("--depth", type=positive_int, default=None, help="maximum tree depth (default: the head's block size - 1)")
    g.add_argument("--tree", choices=TREES, default="exact",
                   help="exact: the best tree by cumulative draft log-prob; paper: the JetSpec paper's heap builder")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="head drafters also draft prompt-lookup continuations (repeats of the context) into each greedy "
                        "tree, competing for the same budget (default: on; --no-lookup: the head's tree alone)")
    g.add_argument("--temperature", type=finite_float, default=0.0)
    g.add_argument("--top-k", type=nonneg_int, default=0)
    g.add_argument("--top-p", type=finite_float, default=1.0)
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto (default): bfloat16 on CUDA or a CPU with native bf16 (AVX512-BF16/AMX), else float32")
    g.add_argument("--exact", choices=["on", "off"], default="off",
                   help="on (CPU): every verify row rounds exactly as a one-token step does, so greedy output is "
                        "token-identical to plain decoding in bfloat16 too, whatever the budget, for up to ~1.35x the "
                        "verify cost; off (default): bfloat16 may round a near-tie differently in a verify "
                        "(float32 agrees)")
    g.add_argument("--target", help="HF model folder (default: SmolLM2-135M-Instruct, converted on first use)")
    g.add_argument("--head", help=f"draft head folder: this project's format, a JetFlow release or a DFlash release "
                                  f"(default: {DEFAULT_HEAD_DIR})")
    g.add_argument("--compare-ar", action="store_true",
                   help="also decode autoregressively; report speedup, losslessness and where outputs first differ")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end (text streams to stderr)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", type=device_arg, default="cpu", help="cpu or cuda[:N] (CUDA verifies trees with the Triton tree kernel)")
    g.add_argument("--threads", type=nonneg_int, default=0, help="torch threads (0: torch's default)")
    g.add_argument("--graphs", choices=["off", "on", "check"], default="off",
                   help="replay the tree build (and on cuda the head's forward, over a paged context) from one capture "
                        "per shape: CUDA graphs on cuda, a replayed ATen trace on a CPU; check: also run each "
                        "eagerly and fail on any difference")
    g.set_defaults(fn=cmd_generate)
    pa = sub.add_parser("paths", help="print (and prepare) the default target and head folders")
    pa.set_defaults(fn=cmd_paths)
    ex = sub.add_parser("export-head", help="write a head in a release layout (jetspec: causal, dflash: bidirectional)")
    ex.add_argument("head_dir", metavar="HEAD_DIR", help="the head folder (this project's format or a release)")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="folder to write config.json and model.safetensors into")
    ex.add_argument("--format", required=True, choices=["jetspec", "dflash"],
                    help="jetspec: causal head (dflash_config.causal_head true); dflash: bidirectional head")
    ex.add_argument("--target", help="the target's HF model folder: checks the head against it and supplies the "
                                     "model_type / layer count the head's config lacks")
    ex.set_defaults(fn=cmd_export_head)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, CheckpointError, HeadMismatchError, OSError) as e:
        print(f"jetflow: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
