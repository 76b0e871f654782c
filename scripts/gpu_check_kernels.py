#!/usr/bin/env python3
"""GPU check of the Triton paged tree-attention kernel: correctness (bf16/fp16/fp32 vs a float64 reference), CUDA-graph
replay, sm_90 register/spill report, and speed vs plain causal paged attention of the same shape.

    python scripts/gpu_check_kernels.py            # on a CUDA machine, < 10 min on an H200; writes
                                                   # bench/results/kernels_<gpu>.json and .md
    python scripts/gpu_check_kernels.py --dry-run  # CPU: Triton interpreter, tiny shapes, fp32/fp16 only, temp dir

"Plain causal" is the same kernel with CAUSAL=True: node i sees the prefix and tree slots 0..i, no mask words are
loaded. So the reported overhead is exactly what reading and applying the tree mask costs. Both run through the same
block table, page size 16.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes; results to a temp dir")
    ap.add_argument("--out", default=None, help="results folder (default bench/results, or a temp dir with --dry-run)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block/warps/stages sweep")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jetflow_sglang.kernels.triton_tree_attn as tta  # noqa: E402
from jetflow_sglang.kernels.reference import tree_attn_reference  # noqa: E402
from jetflow_sglang.kernels.tree_mask import GRAPH_WORDS, pack_ragged  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # relative Frobenius error


def random_parents(n, g):
    return ([-1] if n else []) + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def make_inputs(ns, ps, hq, hkv, d, page, dtype, device, seed, words=GRAPH_WORDS):
    """Random trees, a scattered block table (random page order), tree K/V at the tail of each request's KV."""
    g = torch.Generator().manual_seed(seed)
    mask, indptr = pack_ragged([random_parents(n, g) for n in ns], words)
    pages = [-(-(p + n) // page) for n, p in zip(ns, ps)]
    perm = torch.randperm(sum(pages), generator=g).to(torch.int32)
    table = torch.zeros(len(ns), max(pages), dtype=torch.int32)
    for b, chunk in enumerate(perm.split(pages)):
        table[b, :len(chunk)] = chunk
    gd = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(sum(pages), page, hkv, d, generator=gd, device=device, dtype=dtype)
    v = torch.randn(sum(pages), page, hkv, d, generator=gd, device=device, dtype=dtype)
    q = torch.randn(sum(ns), hq, d, generator=gd, device=device, dtype=dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return q, k, v, to(table), to(torch.tensor(ps, dtype=torch.int32)), to(indptr), to(mask)


def run_kernel(args, causal=False, config=None, out=None, max_q=None, num_splits=1):
    q = args[0]
    max_q = int((args[5][1:] - args[5][:-1]).max()) if max_q is None else max_q  # a sync: pass it when capturing
    return tta._launch(*args, 1.0 / math.sqrt(q.shape[-1]), max_q, causal, out=out, config=config,
                       num_splits=num_splits)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench(fn, gpu):
    """Median milliseconds: triton.testing.do_bench on a GPU, a perf_counter median under the interpreter."""
    if gpu:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def correctness(plan, device, gpu):
    rows = []
    for dtype, ns, ps, hq, hkv, d in tqdm(plan, desc="correctness"):
        args = make_inputs(ns, ps, hq, hkv, d, 16, dtype, device, seed=len(rows))
        out = torch.full_like(args[0], float("nan"))  # poisoned: unwritten rows stay NaN
        run_kernel(args, out=out)
        ref = tree_attn_reference(*args)
        err = rel_err(out, ref)
        causal = run_kernel(args, causal=True)
        cerr = rel_err(causal, tree_attn_reference(*args, causal=True))
        ok = (not out.isnan().any().item()) and err < TOL[dtype] and cerr < TOL[dtype]
        rows.append(dict(dtype=str(dtype).split(".")[-1], ns=ns, prefix=ps, heads=f"{hq}/{hkv}", head_dim=d,
                         rel_err=err, causal_rel_err=cerr, tol=TOL[dtype], ok=ok))
        if gpu:
            del args, out, ref, causal
            torch.cuda.empty_cache()
    return rows


def graph_replay(device, dtype, hq, hkv, d):
    """Capture one bucket (N=64, words padded to 8) in a CUDA graph, change the tree in place, replay, compare."""
    args = make_inputs([64, 64], [1000, 3000], hq, hkv, d, 16, dtype, device, seed=7)
    scale = 1.0 / math.sqrt(d)
    tta.tree_attn_op(*args, scale, 64, False)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tta.tree_attn_op(*args, scale, 64, False)  # the custom op, as torch.compile / the HF path call it
    new = make_inputs([64, 64], [1000, 3000], hq, hkv, d, 16, dtype, device, seed=8)
    for dst, src in zip(args, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out, tree_attn_reference(*args))
    return dict(rel_err=err, ok=err < TOL[dtype])


def hf_check(device, dtype, n=100, p=300):
    """The transformers wiring on this device: tiny random Llama, "jetflow_tree" in a tree context vs eager + a float
    additive mask (the path the core used before the kernel)."""
    import jetflow_sglang.kernels.hf_tree_attention as hta
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    parents = random_parents(n, g)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    from jetflow_sglang.core.tree import ancestor_mask, pack_bits
    anc = ancestor_mask(parents)
    prefix = torch.randint(0, 128, (1, p), generator=g).to(device)
    ids = torch.randint(0, 128, (1, n), generator=g).to(device)
    pos = (p + torch.tensor([depths])).to(device)

    def run(impl, mask, words):
        model.config._attn_implementation = impl
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
        if words is None:
            return model(input_ids=ids, position_ids=pos, past_key_values=cache, attention_mask=mask).logits.float()
        with hta.tree_mask_context(words, p):
            return model(input_ids=ids, position_ids=pos, past_key_values=cache).logits.float()

    with torch.no_grad():
        allow = torch.ones(n, p + n, dtype=torch.bool)
        allow[:, p:] = anc
        add = torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)[None, None].to(device)
        ref = run("eager", add, None)
        got = run(hta.NAME, None, pack_bits(anc).to(device))
    err = ((got - ref).norm() / ref.norm()).item()
    return dict(dtype=str(dtype).split(".")[-1], n=n, prefix=p, rel_err=err, ok=err < 3 * TOL[dtype])


def speed(shapes, hq, hkv, d, dtype, device, gpu):
    rows = []
    for b, n, p in tqdm(shapes, desc="speed"):
        args = make_inputs([n] * b, [p] * b, hq, hkv, d, 16, dtype, device, seed=b * n + p)
        out = torch.empty_like(args[0])
        tree = lambda: run_kernel(args, out=out, max_q=n)  # noqa: E731  (max_q given: no sync in the timed loop)
        causal = lambda: run_kernel(args, causal=True, out=out, max_q=n)  # noqa: E731
        tree_ms, causal_ms = bench(tree, gpu), bench(causal, gpu)
        row = dict(batch=b, n=n, prefix=p, tree_ms=tree_ms, causal_ms=causal_ms, overhead=tree_ms / causal_ms - 1)
        if gpu:  # the same pair inside CUDA graphs (no Python launch cost), as a graph-captured verify would run
            try:
                tg = triton.testing.do_bench_cudagraph(tree, return_mode="median")
                cg = triton.testing.do_bench_cudagraph(causal, return_mode="median")
                row.update(tree_graph_ms=tg, causal_graph_ms=cg, graph_overhead=tg / cg - 1)
            except Exception as e:  # informational only
                row["tree_graph_ms"] = f"failed: {type(e).__name__}"
        if gpu:  # context: torch SDPA (flash, contiguous, no mask) over the same prefix + tree per request
            try:
                qs = torch.randn(b, hq, n, d, device=device, dtype=dtype)
                ks = torch.randn(b, hkv, p + n, d, device=device, dtype=dtype)
                row["sdpa_nomask_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, ks, enable_gqa=True), gpu)
                del qs, ks
            except Exception as e:  # informational only
                row["sdpa_nomask_ms"] = f"failed: {type(e).__name__}"
            del args, out
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def split_kv(shapes, hq, hkv, d, dtype, device, gpu):
    """Split-KV (flash-decoding) for long prefixes: the tree kernel with one program per row block and with
    `pick_splits` chunks of the prefix, against SDPA's flash backend over the same prefix + tree with no mask (a
    lower bound for a causal chain of the same length). Goal: split / flash <= 1.25 at prefix 4096, 64 nodes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 132
    rows = []
    for b, n, p in tqdm(shapes, desc="split-kv"):
        args = make_inputs([n] * b, [p] * b, hq, hkv, d, 16, dtype, device, seed=7 * b + n + p)
        splits = tta.pick_splits(p, n, hq, b, d, dtype, sms) if gpu else 4
        one, many = torch.empty_like(args[0]), torch.empty_like(args[0])
        run_kernel(args, out=one, max_q=n)
        run_kernel(args, out=many, max_q=n, num_splits=splits)
        row = dict(batch=b, n=n, prefix=p, splits=splits, split_vs_one_rel_err=rel_err(many, one.double()),
                   tree_ms=bench(lambda: run_kernel(args, out=one, max_q=n), gpu),  # noqa: B023
                   split_ms=bench(lambda: run_kernel(args, out=many, max_q=n, num_splits=splits), gpu))  # noqa: B023
        if gpu:
            qs = torch.randn(b, hq, n, d, device=device, dtype=dtype)
            ks = torch.randn(b, hq, p + n, d, device=device, dtype=dtype)  # heads expanded: flash takes no GQA here
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    row["flash_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks), gpu)  # noqa: B023
                row["split_over_flash"] = row["split_ms"] / row["flash_ms"]
            except Exception as e:  # informational only: the goal then reads None
                row["flash_ms"] = f"failed: {type(e).__name__}"
            del qs, ks
        rows.append(row)
    return rows


def sweep(shapes, hq, hkv, d, dtype, device, gpu):
    configs = [tta.Config(m, nb, w, s) for m, nb, w, s in
               [(64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2), (64, 128, 8, 2), (64, 32, 4, 3)]]
    rows = []
    for b, n, p in tqdm(shapes, desc="sweep"):
        args = make_inputs([n] * b, [p] * b, hq, hkv, d, 16, dtype, device, seed=1)
        out = torch.empty_like(args[0])
        for cfg in configs:
            try:
                ms = bench(lambda: run_kernel(args, config=cfg, out=out, max_q=n), gpu)
            except Exception as e:  # e.g. out of shared memory for a large config
                ms = f"failed: {type(e).__name__}"
            rows.append(dict(batch=b, n=n, prefix=p, config=cfg.__dict__, tree_ms=ms))
    return rows


def aot_report():
    try:
        from experimental.triton_aot import aot_compile

        return [aot_compile(dd, dt) for dd, dt in tta.SHIPPED]
    except Exception as e:  # toolchain missing: report, do not fail the run
        return [dict(error=f"{type(e).__name__}: {e}")]


class _Pool:
    """The head pool's per-layer buffers alone (HeadKVPool without a head): one layer, [slots, Hkv, D]."""

    def __init__(self, slots, hkv, d, dtype, device, g):
        self.k = [torch.randn(slots, hkv, d, generator=g, device=device).to(dtype)]
        self.v = [torch.randn(slots, hkv, d, generator=g, device=device).to(dtype)]

    def gather(self, slots):
        from jetflow_sglang.sglang.head_pool import HeadKVPool

        return HeadKVPool.gather(self, slots)


def head_context(shapes, hq, hkv, d, dtype, device, gpu, block=16):
    """The server head's context read paged (sglang/head_pool.PagedLayer: the Triton kernel over the pool, the
    block's rows written to the reserved slots) against padded (the rows gathered, concatenated with the block's, one
    SDPA): the same output, and what each costs per layer; on a GPU also the paged read captured in a CUDA graph and
    replayed after the contexts grew."""
    import torch.nn.functional as F

    from jetflow_sglang.draft.paged import PagedContext

    rows = []
    for b, ctx in tqdm(shapes, desc="head context"):
        g = torch.Generator(device=device).manual_seed(b * 7919 + ctx)
        width = ctx + 4 * block
        pool = _Pool(b * width + 1, hkv, d, dtype, device, g)
        table = (torch.randperm(b * width, generator=g, device=device) + 1).view(b, width).to(torch.int32)
        rpi = torch.arange(b, device=device)
        lens = torch.randint(ctx // 2, ctx + 1, (b,), generator=g, device=device)
        q = torch.randn(b, hq, block, d, generator=g, device=device).to(dtype)
        k = torch.randn(b, hkv, block, d, generator=g, device=device).to(dtype)
        v = torch.randn(b, hkv, block, d, generator=g, device=device).to(dtype)
        inner = torch.ones(block, block, dtype=torch.bool, device=device).tril()[None].expand(b, -1, -1)
        max_len = int(lens.max())

        def padded():
            (ck, cv), = pool.gather(torch.where(torch.arange(max_len, device=device)[None] < lens[:, None],
                                                table[:, :max_len].long(), 0))
            seen = (torch.arange(max_len, device=device)[None] < lens[:, None])[:, None].expand(-1, block, -1)
            mask = torch.cat([seen, inner], 2)
            return F.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2),
                                                  attn_mask=mask[:, None], enable_gqa=hq != hkv)

        def paged():
            return PagedContext(pool, table, rpi, lens, block)[0].attend(q, k, v, inner)

        err = rel_err(paged(), padded().float())
        row = dict(batch=b, ctx=ctx, block=block, rel_err=err, ok=err < TOL[dtype],
                   paged_ms=bench(paged, gpu), padded_ms=bench(padded, gpu))
        if gpu:  # static shapes: capture once, let every context grow by a few tokens, replay
            paged()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = paged()
            lens.add_(3)
            max_len = int(lens.max())
            graph.replay()
            torch.cuda.synchronize()
            row["graph_rel_err"] = rel_err(out, padded().float())
            row["ok"] = row["ok"] and row["graph_rel_err"] < TOL[dtype]
        rows.append(row)
        if gpu:
            del pool, table
            torch.cuda.empty_cache()
    return rows


def write_md(res, path):
    lines = [f"# Tree-attention kernel check: {res['gpu']}", "", f"- command: `{res['command']}`",
             f"- torch {res['torch']}, triton {res['triton']}, python {res['python']}, {res['when']}",
             f"- wall time {res['wall_s']:.0f} s; dry run: {res['dry_run']}", "",
             "## Correctness (relative Frobenius error vs float64; tree mask and the causal baseline)", "",
             "| dtype | n per request | prefix | heads | D | tree err | causal err | tol | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["correctness"]:
        lines.append(f"| {r['dtype']} | {r['ns']} | {r['prefix']} | {r['heads']} | {r['head_dim']} | {r['rel_err']:.2e} "
                     f"| {r['causal_rel_err']:.2e} | {r['tol']:.0e} | {'yes' if r['ok'] else '**NO**'} |")
    if res.get("cuda_graph"):
        lines += ["", f"CUDA graph replay after an in-place tree change: rel err {res['cuda_graph']['rel_err']:.2e}, "
                  f"ok={res['cuda_graph']['ok']}"]
    for h in res.get("hf", []):
        lines += ["", f"transformers 'jetflow_tree' (tiny Llama, {h['dtype']}, N={h['n']}, prefix {h['prefix']}) vs eager "
                  f"+ float mask: rel err {h['rel_err']:.2e}, ok={h['ok']}"]
    lines += ["", f"## Speed ({res['speed_dtype']}, heads {res['heads']}, D {res['head_dim']}, page 16; medians)", "",
              "Tree-mask overhead = tree / causal - 1 (same kernel, causal mode loads no mask).", "",
              "Graph columns: the same pair timed inside CUDA graphs (triton.testing.do_bench_cudagraph).", "",
              "| batch | N | prefix | tree ms | causal ms | overhead | graph tree ms | graph causal ms | graph overhead "
              "| SDPA no-mask ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["speed"]:
        sd = r.get("sdpa_nomask_ms", "-")
        sd = f"{sd:.4f}" if isinstance(sd, float) else sd
        fmt = lambda x, pct=False: (f"{100 * x:+.1f}%" if pct else f"{x:.4f}") if isinstance(x, float) else str(x)  # noqa: E731
        lines.append(f"| {r['batch']} | {r['n']} | {r['prefix']} | {r['tree_ms']:.4f} | {r['causal_ms']:.4f} "
                     f"| {100 * r['overhead']:+.1f}% | {fmt(r.get('tree_graph_ms', '-'))} "
                     f"| {fmt(r.get('causal_graph_ms', '-'))} | {fmt(r.get('graph_overhead', '-'), True)} | {sd} |")
    g = res["goal"]
    lines += ["", f"Goal (overhead <= 10% at N <= 256, prefix >= 4k): {g['met']} (max overhead over "
              f"{g['shapes']} shapes: {g['max_overhead']})"]
    if res.get("split_kv"):
        lines += ["", "## Split-KV for long prefixes (tree kernel, ms)", "",
                  "| batch | N | prefix | splits | split vs one rel err | one program ms | split ms | SDPA flash ms "
                  "| split / flash |", "|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda x: f"{x:.4f}" if isinstance(x, float) else str(x)  # noqa: E731
        for r in res["split_kv"]:
            lines.append(f"| {r['batch']} | {r['n']} | {r['prefix']} | {r['splits']} | {r['split_vs_one_rel_err']:.1e} "
                         f"| {fmt(r['tree_ms'])} | {fmt(r['split_ms'])} | {fmt(r.get('flash_ms', '-'))} "
                         f"| {fmt(r.get('split_over_flash', '-'))} |")
        sg = res["split_goal"]
        lines += ["", f"Goal (split / flash <= 1.25 at prefix 4096, 64 nodes): {sg['met']} ({sg['ratio']})"]
    if res.get("head_context"):
        lines += ["", "## The server head's context: paged (Triton, in place) vs padded (gather + SDPA), one layer",
                  "", "| batch | context | block | rel err | graph replay err | paged ms | padded ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["head_context"]:
            ge = r.get("graph_rel_err")
            lines.append(f"| {r['batch']} | {r['ctx']} | {r['block']} | {r['rel_err']:.1e} | "
                         f"{'-' if ge is None else f'{ge:.1e}'} | {r['paged_ms']:.4f} | {r['padded_ms']:.4f} |")
    if res.get("sweep"):
        lines += ["", "## Config sweep (tree kernel, ms)", "", "| batch | N | prefix | config | ms |", "|---|---|---|---|---|"]
        for r in res["sweep"]:
            ms = r["tree_ms"]
            lines.append(f"| {r['batch']} | {r['n']} | {r['prefix']} | {r['config']} | "
                         f"{ms:.4f} |" if isinstance(ms, float) else f"| {r['batch']} | {r['n']} | {r['prefix']} | {r['config']} | {ms} |")
    lines += ["", "## sm_90a compile of the shipped configs (bundled ptxas)", "", "```"]
    lines += [json.dumps(a) for a in res["aot"]] + ["```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    t0 = time.time()
    gpu = not ARGS.dry_run
    if gpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on CPU")
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    if gpu:
        hq, hkv, d = 32, 8, 128
        shapes = [(b, n, p) for b in (1, 8, 32) for n in (16, 64, 256) for p in (1024, 16384)]
        plan = [(dt, ns, ps, hq, hkv, d) for dt in (torch.bfloat16, torch.float16, torch.float32)
                for ns, ps in [([256], [16384]), ([64] * 8, [1024] * 8), ([16] * 32, [1024] * 32),
                               ([256, 17, 100, 1], [0, 4000, 16000, 5])]]
        sweep_shapes = [(1, 256, 16384), (8, 64, 16384), (32, 16, 1024)]
        split_shapes = [(1, 64, 4096), (1, 64, 16384), (1, 16, 4096), (1, 256, 4096), (4, 64, 4096)]
        head_shapes = [(b, c) for b in (1, 8, 32) for c in (1024, 4096, 16384)]
        dtype = torch.bfloat16
    else:
        torch.set_num_threads(1)
        hq, hkv, d = 4, 2, 32
        shapes = [(1, 16, 0), (2, 40, 70)]
        plan = [(dt, ns, ps, hq, hkv, d) for dt in (torch.float32, torch.float16)
                for ns, ps in [([40], [70]), ([16, 33, 1], [0, 100, 5])]]
        sweep_shapes = [(1, 40, 70)]
        split_shapes = [(1, 16, 300), (2, 8, 70)]
        head_shapes = [(1, 40), (3, 70)]
        dtype = torch.float16  # bf16 tl.dot is broken in the interpreter (triton #11584)
    gpu_name = torch.cuda.get_device_name() if gpu else f"cpu-interpreter-{platform.machine()}"
    res = dict(gpu=gpu_name, command=" ".join([os.path.basename(sys.executable)] + sys.argv), dry_run=not gpu,
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), heads=f"{hq}/{hkv}", head_dim=d,
               speed_dtype=str(dtype).split(".")[-1])
    res["correctness"] = correctness(plan, device, gpu)
    res["cuda_graph"] = graph_replay(device, torch.bfloat16, hq, hkv, d) if gpu else None
    if not gpu:
        import jetflow_sglang.kernels.hf_tree_attention as hta
        hta.FORCE_TRITON = True  # the interpreter runs the kernel on CPU tensors
    res["hf"] = ([hf_check(device, dt) for dt in (torch.bfloat16, torch.float32)] if gpu
                 else [hf_check(device, torch.float32, n=40, p=50)])
    res["speed"] = speed(shapes, hq, hkv, d, dtype, device, gpu)
    long = [r for r in res["speed"] if r["prefix"] >= 4096 and r["n"] <= 256]
    worst = max((r["overhead"] for r in long), default=None)
    res["goal"] = dict(shapes=len(long), max_overhead=worst, met=None if worst is None else worst <= 0.10)
    res["split_kv"] = split_kv(split_shapes, hq, hkv, d, dtype, device, gpu)
    res["head_context"] = head_context(head_shapes, hq, hkv, d, dtype, device, gpu)
    target = [r.get("split_over_flash") for r in res["split_kv"] if (r["batch"], r["n"], r["prefix"]) == (1, 64, 4096)]
    ratio = target[0] if target and isinstance(target[0], float) else None
    res["split_goal"] = dict(ratio=ratio, met=None if ratio is None else ratio <= 1.25)
    res["sweep"] = [] if ARGS.no_sweep else sweep(sweep_shapes, hq, hkv, d, dtype, device, gpu)
    res["aot"] = aot_report() if gpu else [dict(skipped="needs the real JIT (no interpreter); see the CPU test")]
    res["wall_s"] = time.time() - t0

    out_dir = ARGS.out or (os.path.join(ROOT, "bench", "results") if gpu else tempfile.mkdtemp(prefix="kernels_dry_"))
    os.makedirs(out_dir, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_")
    base = os.path.join(out_dir, f"kernels_{slug}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_md(res, base + ".md")
    bad = [r for r in res["correctness"] + res["hf"] if not r["ok"]] + \
        [r for r in res["split_kv"] if not r["split_vs_one_rel_err"] < TOL[dtype]] + \
        [r for r in res["head_context"] if not r["ok"]] + ([res["cuda_graph"]] if gpu and not res["cuda_graph"]["ok"] else [])
    print(f"wrote {base}.json and .md in {res['wall_s']:.0f} s; correctness failures: {len(bad)}; goal: {res['goal']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
