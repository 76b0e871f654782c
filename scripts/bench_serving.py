"""Serving benchmark: SGLang without speculation, JETFLOW (fixed budgets and auto), SGLang's own NGRAM and SGLang's own
DFLASH, same build.

For each server configuration it starts `python -m sglang.launch_server` on 127.0.0.1 and runs two workloads:
  mixed          GSM8K and MT-Bench chat prompts (interleaved), at every concurrency level
  shared-prefix  one ~400-token system prompt + different questions (the radix cache serves the prefix)
--sets replaces the mixed workload with one workload per held-out prompt set of ../shared/data (gsm8k, math500,
humaneval, mtbench: the first --requests prompts of each, as chat messages; long1k and long4k: MATH-500 problems with
their solutions, about 1k and 4k tokens of context, then one question about them). Each request streams, so TTFT (first
chunk), TPOT (mean time per output token after the first), ITL (mean gap between streamed chunks, as SGLang's own
client reports it: a speculative round streams several tokens at once) and end-to-end latency are measured per
request; throughput is output tokens / wall time of the level; the accept length is the
server's (`spec_accept_length` in meta_info). Results: <out>.json, <out>.md and <out>.png.

    python scripts/bench_serving.py                          # default SmolLM2 + shipped head, CPU, all configs
    python scripts/bench_serving.py --configs nospec jetflow-b8 --concurrency 1 4 --requests 16
    python scripts/bench_serving.py --burst 3 ...            # every level starts with 3 s of load on every core
    python scripts/bench_serving.py --sets gsm8k math500 humaneval mtbench --prefix-concurrency \
        --configs nospec jetflow-b1 jetflow-b8 jetflow-b16 jetflow-b32 jetflow-default --concurrency 1 4
                                                             # the budget sweep: one workload per held-out set
    python scripts/bench_serving.py --dflash-head DIR --dflash-blocks 8,16 \
        --configs nospec jetflow-default dflash-b8 dflash-b16 jetflow-dflash-b16   # SGLang's DFLASH beside JETFLOW

dflash-bN: SGLang's own DFLASH with block size N on a DFlash release-layout head (--dflash-head; default: an export of
the shipped bidirectional head, where it can be exported), made to run on the CPU by
jetflow_sglang/sglang/cpu/dflash_peer.py (JETFLOW_BENCH_DFLASH_PEER=1 in those servers' environment only).
jetflow-bN: JETFLOW at a fixed budget N (1-512; jetflow-b1 is JETFLOW's plain step alone: the same serving stack
without speculation, the second baseline). nospec-treenative: plain SGLang on jetflow_tree_native, the attention
backend of JETFLOW's CPU servers; between it and jetflow-b1 lie the worker's loop and its CPU GEMM (cpu/gemm.py).
jetflow-dflash-bN: JETFLOW on the same head with JETFLOW_DRAFTER=dflash, lookup off and a fixed budget N: the same
drafts, so it accepts what dflash-bN accepts (tests/sglang/test_dflash_peer.py) and the two differ in serving cost only.

A round that other processes slowed (their CPU over --max-foreign-cpu of a core) is run again, up to --retries
times; the discarded rounds stay in the JSON. --burst makes that load on purpose, the same for every configuration,
to measure how each recovers from it (the burst's own CPU is counted apart, not as foreign).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang"))
from sgl_server import Server, process_tree_cpu_s  # noqa: E402  (the same launcher the e2e tests use)

from jetflow_sglang.core.tree import MAX_BUDGET  # noqa: E402
from jetflow_sglang.machine import bf16_isa, cpu_model  # noqa: E402


CONFIGS = ("nospec", "jetflow-b8", "jetflow-b16", "jetflow-default", "jetflow-auto", "ngram")  # the default run
EXTRA = ("nospec-treenative",  # plain SGLang on JETFLOW's CPU attention backend: the backend's share of jetflow-b1
         "jetflow-auto-nolookup", "jetflow-b8-nolookup", "jetflow-b16-nolookup",  # JETFLOW_LOOKUP=off (the head alone)
         "jetflow-default-overlap", "jetflow-b8-overlap",  # on SGLang's overlap scheduler (JETFLOW_OVERLAP=on)
         "jetflow-default-graphs", "jetflow-b8-graphs")  # round pieces replayed from captures (JETFLOW_GRAPHS=on)
SYSTEM = ("You are a careful assistant for a school. Answer the question that follows. Explain every step of your "
          "reasoning in plain words, check each number twice, keep units consistent, and end with a short summary "
          "sentence that states the final answer. Be polite and concise, avoid jargon, and never invent facts. ")


SHARED_DATA = ROOT.parent / "shared" / "data"  # the project's prompt sets (never downloaded at run time)
SETS = {  # --sets name -> (file under SHARED_DATA, how a row gives its prompt): held-out splits only
    "gsm8k": ("gsm8k/test.jsonl", lambda r: r["question"]),
    "math500": ("math500/test.jsonl", lambda r: r["problem"]),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", lambda r: "Complete this Python function.\n\n" + r["prompt"]),
    "mtbench": ("mt_bench/question.jsonl", lambda r: r["turns"][0]),
}


LONG_SETS = {"long1k": 1000, "long4k": 4000}  # --sets name -> context tokens (MATH-500's LaTeX: ~2 characters each)


def long_prompts(n: int, tokens: int) -> list[str]:
    """n long-context prompts of about `tokens` tokens from held-out MATH-500 (problems with their worked solutions,
    consecutive and different for each prompt), ending in one question about them: the head and the verify read the
    whole context every round, and prompt lookup finds what the answer repeats."""
    rows = [json.loads(ln) for ln in (SHARED_DATA / SETS["math500"][0]).read_text().splitlines() if ln.strip()]
    out, k = [], 0
    for _ in range(n):
        doc = []
        while sum(map(len, doc)) < 2 * tokens:
            r = rows[k % len(rows)]
            doc.append(f"Problem {len(doc) + 1}. {r['problem']}\nSolution. {r['solution']}\n\n")
            k += 1
        out.append("".join(doc) + "Restate the final answer of every problem above, one line each, in order.")
    return out


def load_set(name: str, n: int) -> list[str]:
    """The first n prompts of a held-out set in ../shared/data (SETS), or n long-context ones (LONG_SETS)."""
    import gzip

    if name in LONG_SETS:
        return long_prompts(n, LONG_SETS[name])
    rel, prompt = SETS[name]
    path = SHARED_DATA / rel
    if not path.is_file():
        raise FileNotFoundError(f"--sets {name}: {path} is missing (the project's prompt sets live in ../shared/data)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    return [prompt(r) for r in rows[:n]]


def jetflow_budget(name: str) -> int | None:
    """N of a `jetflow-bN` config (a fixed budget), else None."""
    tail = name.removeprefix("jetflow-b")
    return int(tail) if name.startswith("jetflow-b") and tail.isdigit() else None


def load_prompts(n: int) -> list[str]:
    """GSM8K and MT-Bench prompts, interleaved (bench/data, copied from ../shared/data)."""
    rows = [[json.loads(ln)["prompt"] for ln in (ROOT / "bench" / "data" / f).read_text().splitlines() if ln.strip()]
            for f in ("gsm8k.jsonl", "mtbench.jsonl")]
    out = []
    for i in range(max(len(r) for r in rows)):
        out += [r[i] for r in rows if i < len(r)]
    return (out * (n // len(out) + 1))[:n]


def chat_ids(tok, messages) -> list[int]:
    x = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def system_prompt(tok, n_tokens: int) -> str:
    text = SYSTEM
    while len(tok(text).input_ids) < n_tokens:
        text += SYSTEM
    ids = tok(text).input_ids[:n_tokens]
    return tok.decode(ids)


DFLASH_PEER_ENV = {"JETFLOW_BENCH_DFLASH_PEER": "1"}  # cpu/dflash_peer.py: SGLang's DFLASH on the CPU, these servers only


def dflash_block(name: str) -> int | None:
    """N of a `dflash-bN` / `jetflow-dflash-bN` config, else None."""
    for prefix in ("dflash-b", "jetflow-dflash-b"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):])
    return None


def config_args(name: str, head: str | None, drafter: str, dflash_head: str | None = None) -> tuple[list[str], dict]:
    """(server flags, server environment) of a configuration. dflash_head: the DFlash release-layout head of the
    dflash-bN and jetflow-dflash-bN configs."""
    block = dflash_block(name)
    if block is not None:
        if not dflash_head:
            raise ValueError(f"{name} needs a DFlash release-layout head (--dflash-head DIR)")
        if name.startswith("dflash-b"):  # SGLang's own DFLASH; its target verifies through JetFlow's tree backend
            return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", dflash_head,
                    "--speculative-num-draft-tokens", str(block), "--attention-backend", "jetflow_tree_native"], \
                dict(DFLASH_PEER_ENV)
        return ["--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path", dflash_head,  # same drafts
                "--speculative-num-draft-tokens", str(block)], {"JETFLOW_DRAFTER": "dflash", "JETFLOW_LOOKUP": "off"}
    head_args = ["--speculative-draft-model-path", head] if head and drafter not in ("ngram", "ar") else []
    env = {"JETFLOW_DRAFTER": drafter}
    if name.endswith("-overlap"):  # the worker on SGLang's overlap scheduler (a CPU server is synchronous otherwise)
        name, env = name.removesuffix("-overlap"), {**env, "JETFLOW_OVERLAP": "on"}
    if name.endswith("-nolookup"):  # without it JETFLOW_LOOKUP is auto: on for a CPU server
        name, env = name.removesuffix("-nolookup"), {**env, "JETFLOW_LOOKUP": "off"}
    if name.endswith("-graphs"):  # the tree build and acceptance replayed from captures (core/graphs.py)
        name, env = name.removesuffix("-graphs"), {**env, "JETFLOW_GRAPHS": "on"}
    if name == "nospec":
        return [], {}
    if name == "nospec-treenative":  # no speculation, the attention backend JETFLOW's CPU servers verify with
        return ["--attention-backend", "jetflow_tree_native"], {}
    if name == "ngram":  # SGLang's own algorithm; on CPU it verifies through JetFlow's tree backend
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                "--attention-backend", "jetflow_tree_native"], {}
    if name == "jetflow-default":  # what a user gets with no budget setting: auto (config.DEFAULT_BUDGET)
        return ["--speculative-algorithm", "JETFLOW", *head_args], env
    if name == "jetflow-auto":  # auto up to 16 nodes
        return ["--speculative-algorithm", "JETFLOW", "--speculative-num-draft-tokens", "16", *head_args], \
            {**env, "JETFLOW_BUDGET": "auto"}
    budget = int(name.rsplit("-b", 1)[1])
    return ["--speculative-algorithm", "JETFLOW", "--speculative-num-draft-tokens", str(budget), *head_args], env


def stream_one(url: str, ids: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
    first, last_meta, chunks = None, {}, []
    with requests.post(url + "/generate", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunks.append(time.perf_counter() - t0)
            if first is None:
                first = chunks[0]
            last_meta = json.loads(line[5:]).get("meta_info", last_meta)
    e2e = time.perf_counter() - t0
    n = int(last_meta.get("completion_tokens", 0))
    return {"ttft": first if first is not None else e2e, "e2e": e2e, "tokens": n,
            "tpot": (e2e - (first or e2e)) / (n - 1) if n > 1 else 0.0,
            "itl": (chunks[-1] - chunks[0]) / (len(chunks) - 1) if len(chunks) > 1 else 0.0,
            "accept": last_meta.get("spec_accept_length"), "verify_ct": last_meta.get("spec_verify_ct"),
            "cached": last_meta.get("cached_tokens", 0)}


def run_level(srv: Server, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """Every prompt once, `concurrency` at a time: (per-request records, wall seconds)."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda ids: stream_one(srv.url, ids, max_tokens), prompts))
    return res, time.perf_counter() - t0


def summarize(concurrency: int, res: list[dict], wall: float) -> dict:
    """One row from the records of a level's rounds (wall: their total wall time)."""
    toks = sum(x["tokens"] for x in res)
    acc = [x["accept"] for x in res if x["accept"] is not None]
    mean = lambda k: round(statistics.mean(x[k] for x in res), 4)  # noqa: E731
    p50 = lambda k: round(statistics.median(x[k] for x in res), 4)  # noqa: E731
    return {"concurrency": concurrency, "requests": len(res), "output_tokens": toks, "wall_s": round(wall, 3),
            "output_tok_per_s": round(toks / wall, 3), "ttft_mean_s": mean("ttft"), "ttft_p50_s": p50("ttft"),
            "tpot_mean_ms": round(1000 * statistics.mean(x["tpot"] for x in res), 3),
            "itl_mean_ms": round(1000 * statistics.mean(x["itl"] for x in res), 3),
            "e2e_mean_s": mean("e2e"), "e2e_p50_s": p50("e2e"), "e2e_max_s": round(max(x["e2e"] for x in res), 4),
            "accept_length": round(statistics.mean(acc), 3) if acc else None,
            "tokens_per_verify": tokens_per_verify(res),
            "cached_tokens_mean": round(statistics.mean(x["cached"] for x in res), 1)}


def tokens_per_verify(res: list[dict]) -> float | None:
    """Output tokens per target verify step over the requests that report verify steps (SGLang's spec_verify_ct;
    the same ratio as its spec_accept_length, pooled over requests), None without speculation."""
    rows = [x for x in res if x.get("verify_ct")]
    return round(sum(x["tokens"] for x in rows) / sum(x["verify_ct"] for x in rows), 3) if rows else None


class Burst:
    """`seconds` of load on every core (one busy process each), started now: a neighbour's job on a shared CPU.
    join() waits for them; their CPU then counts in this process's reaped children (cpu_snapshot's "burst")."""

    def __init__(self, seconds: float):
        loop = f"import time\nend = time.perf_counter() + {seconds}\nwhile time.perf_counter() < end: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 1)] \
            if seconds > 0 else []

    def join(self) -> None:
        for p in self.procs:
            p.wait()


def cpu_snapshot(servers: dict) -> dict:
    """CPU seconds so far: per server, this benchmark process (its client threads), its finished children (the
    bursts: servers are never reaped during a level), and the whole machine."""
    import psutil

    m = psutil.cpu_times()
    busy = m.user + m.system + getattr(m, "nice", 0) + getattr(m, "irq", 0) + getattr(m, "softirq", 0) + \
        getattr(m, "steal", 0)
    me = psutil.Process().cpu_times()  # this process alone (its client threads); the servers are its children
    return {"servers": {n: process_tree_cpu_s(s.proc.pid) for n, s in servers.items()}, "bench": me.user + me.system,
            "burst": me.children_user + me.children_system, "machine": busy}


def cpu_during(before: dict, after: dict, measured: str) -> dict:
    """Where the CPU went during one level of one server: the measured server itself, the other (idle) servers, the
    deliberate burst, and everything else on the machine (foreign). A level slowed by load shows up here instead of
    as a mystery."""
    own = after["servers"].get(measured, 0.0) - before["servers"].get(measured, 0.0)
    others = sum(after["servers"][n] - before["servers"].get(n, 0.0) for n in after["servers"] if n != measured)
    bench, burst = after["bench"] - before["bench"], after["burst"] - before["burst"]
    foreign = (after["machine"] - before["machine"]) - own - others - bench - burst
    return {"own_cpu_s": round(own, 2), "other_servers_cpu_s": round(others, 2), "burst_cpu_s": round(burst, 2),
            "foreign_cpu_s": round(max(0.0, foreign), 2)}


def busy_processes(seconds: float = 2.0, min_cores: float = 0.25) -> list[dict]:
    """Processes other than this benchmark and its children that used more than `min_cores` of a core over `seconds`,
    busiest first: what would slow the levels (an idle SGLang server started without --sleep-on-idle busy-polls a
    whole core)."""
    import psutil

    mine = {psutil.Process().pid, *(c.pid for c in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["pid", "cmdline", "name"]) if p.pid not in mine]
    before = {}
    for p in procs:
        try:
            t = p.cpu_times()
            before[p.pid] = (p, t.user + t.system)
        except psutil.Error:
            pass
    time.sleep(seconds)
    busy = []
    for pid, (p, cpu0) in before.items():
        try:
            t = p.cpu_times()
            cores = (t.user + t.system - cpu0) / seconds
        except psutil.Error:
            continue
        if cores > min_cores:
            cmd = " ".join(p.info.get("cmdline") or [p.info.get("name") or "?"])
            busy.append({"pid": pid, "cores": round(cores, 2), "command": cmd.strip()[:120]})
    return sorted(busy, key=lambda b: -b["cores"])


def loaded_rounds(results: list[dict], max_foreign_cpu: float) -> list[str]:
    """The kept rounds that foreign load still slowed (its retries used up, or --retries 0): each as
    'config workload c=N round K: X cores busy elsewhere'."""
    out = []
    for r in results:
        for k, cpu in enumerate(r.get("round_cpu") or [], 1):
            wall = cpu.get("wall_s") or 0
            if wall > 0 and cpu["foreign_cpu_s"] > max_foreign_cpu * wall:
                out.append(f"{r['config']} {r['workload']} c={r['concurrency']} round {k}: "
                           f"{cpu['foreign_cpu_s'] / wall:.1f} cores busy elsewhere")
    return out


def server_state(srv: Server) -> dict:
    try:
        info = requests.get(srv.url + "/server_info", timeout=30).json()
        st = info["internal_states"][0]
        return {"avg_spec_accept_length": st.get("avg_spec_accept_length"), "jetflow": st.get("jetflow")}
    except (requests.RequestException, KeyError, IndexError, ValueError, TypeError):
        return {}


JETFLOW_ROUND_FIELDS = ("host_syncs_per_round", "round_split", "recent_budgets")  # the JETFLOW worker's per-round cost, where it has them


def jetflow_round_fields(state: dict) -> dict:
    """The JETFLOW worker's per-round cost fields from a server_state() (absent fields are left out)."""
    jet = state.get("jetflow") if isinstance(state, dict) else None
    return {k: jet[k] for k in JETFLOW_ROUND_FIELDS if isinstance(jet, dict) and k in jet}


def dflash_head_dir(given: str | None, shipped_head: str | None, target: str, workdir: Path) -> tuple[str | None, str]:
    """(the DFlash release-layout head of the dflash configs, or None; why not). `given`: --dflash-head, checked to
    be a bidirectional DFlash-layout folder. Without it: an export of the shipped bidirectional head
    (jetflow_sglang.head.export), where the exporter exists and accepts that head."""
    if given:
        from jetflow_sglang.head.config import read_config
        from jetflow_sglang.head.formats import DFLASH, detect_format

        cfg_path = Path(given) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"--dflash-head {given}: no config.json there")
        raw = read_config(cfg_path)
        if detect_format(raw, str(cfg_path)) != DFLASH:
            raise ValueError(f"--dflash-head {given}: not a DFlash release-layout head (architectures "
                             f"{raw.get('architectures')!r}); export one with `jetflow export-head --format dflash`")
        if (raw.get("dflash_config") or {}).get("causal_head") or raw.get("is_causal"):
            raise ValueError(f"--dflash-head {given}: a causal head; the dflash configs compare DFlash's bidirectional "
                             "drafting (jetflow-dflash-bN drafts with JETFLOW_DRAFTER=dflash): pass a bidirectional "
                             "release-layout head")
        return given, ""
    from jetflow_sglang.paths import bidir_dir

    src = bidir_dir(shipped_head) if shipped_head else None
    if src is None or not (src / "config.json").is_file():
        return None, "no bidirectional head beside the JetFlow head to export; pass --dflash-head DIR (a DFlash " \
                     "release-layout head)"
    try:
        from jetflow_sglang.head.export import export_head
    except ImportError:
        return None, "this checkout has no head exporter (jetflow_sglang.head.export); pass --dflash-head DIR (a " \
                     "DFlash release-layout head)"
    out = workdir / "dflash-head"
    try:
        export_head(str(src), str(out), "dflash", target_dir=target)
    except Exception as e:  # noqa: BLE001 - the exporter's refusal is the user's one line
        return None, f"{src} cannot be exported to the DFlash layout ({' '.join(str(e).split())[:400]}); pass " \
                     "--dflash-head DIR (a DFlash release-layout head)"
    return str(out), ""


def write_report(out: Path, meta: dict, results: list[dict], failures: dict) -> str:
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, "failures": failures},
                                                   indent=2))
    base = {(r["workload"], r["concurrency"]): r["output_tok_per_s"] for r in results if r["config"] == "nospec"}
    base_rounds = {(r["workload"], r["concurrency"]): r.get("round_tok_per_s") for r in results
                   if r["config"] == "nospec"}
    # the second baseline: a JETFLOW server deciding nothing (budget 1: one-node trees, no head forward), so the same
    # serving stack as every JETFLOW row (its CPU GEMMs, its attention backend) without speculation
    same_stack = {(r["workload"], r["concurrency"]): r["output_tok_per_s"] for r in results
                  if r["config"] == "jetflow-b1"}
    names = list(dict.fromkeys(r["config"] for r in results))
    lines = [f"# SGLang serving: {', '.join(names)} ({meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"model `{meta['model']}`, head `{meta['head']}`, drafter `{meta['drafter']}`, dtype {meta['dtype']}, "
             f"{meta['requests_per_level']} requests per level and round, {meta.get('rounds', 1)} round(s) pooled "
             f"({meta.get('workloads', 'GSM8K + MT-Bench chat prompts')}), max_tokens "
             f"{meta['max_tokens']}, greedy, radix cache on; shared-prefix: a {meta['prefix_tokens']}-token system "
             f"prompt + different questions; {meta.get('threads', 1)} torch threads per server; machine: {meta['machine']}; sglang {meta['sglang']}, torch {meta['torch']}.",
             "", "| workload | config | conc. | output tok/s | vs nospec | vs jetflow-b1 | per round (min-max) | "
                 "TTFT mean (s) | TPOT mean (ms) | ITL mean (ms) | e2e mean (s) | e2e p50 | e2e max | accept len | cached tok | "
                 "others' CPU s (max round) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = base.get((r["workload"], r["concurrency"]))
        sp = f"{r['output_tok_per_s'] / b:.2f}x" if b else "-"
        b1 = same_stack.get((r["workload"], r["concurrency"]))
        sp1 = f"{r['output_tok_per_s'] / b1:.2f}x" if b1 and r["config"] != "jetflow-b1" else "-"
        acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        ratios = round_ratios(r.get("round_tok_per_s"), base_rounds.get((r["workload"], r["concurrency"])))
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios and r["config"] != "nospec" else "-"
        lines.append(f"| {r['workload']} | {r['config']} | {r['concurrency']} | {r['output_tok_per_s']:.1f} | {sp} | "
                     f"{sp1} | {spread} | "
                     f"{r['ttft_mean_s']:.3f} | {_ms(r.get('tpot_mean_ms'))} | {r['itl_mean_ms']:.1f} | {r['e2e_mean_s']:.2f} | {r['e2e_p50_s']:.2f} "
                     f"| {r['e2e_max_s']:.2f} | {acc} | {r['cached_tokens_mean']:.0f} | {_others(r)} |")
    lines += round_table(results)
    lines += ["", "All servers run at once with `--sleep-on-idle`; each level runs every configuration back to back, "
              "in an order that rotates from level to level, and starts with a flushed cache.",
              "", "Others' CPU: CPU seconds that the other (idle) servers / everything else on the machine used while "
              "this level ran, the largest round; a slow round with a large number there was slowed by load. "
              f"A round with foreign CPU above {meta.get('max_foreign_cpu', 0.25)} of a core was run again (up to "
              f"{meta.get('retries', 0)} times); discarded rounds: "
              f"{sum(len(r.get('discarded_rounds', [])) for r in results)} (in the JSON)."]
    if meta.get("burst_s"):
        lines += ["", f"**Burst:** every level started with {meta['burst_s']:g} s of load on every core (one busy "
                  "process per core), the same for every configuration: the ratios show how each recovers from it."]
    for b in meta.get("busy_at_start") or []:
        lines += ["", f"**Busy before the run:** pid {b['pid']} used {b['cores']} cores: `{b['command']}`"]
    loaded = loaded_rounds(results, meta.get("max_foreign_cpu", 0.25))
    if loaded:
        lines += ["", "**Rounds kept under foreign load** (their reruns used up): " + "; ".join(loaded) +
                  ". Their ratios measure that load, not the server."]
    for name, why in failures.items():
        lines += ["", f"**{name} did not run**: {why}"]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    _plot(out.with_suffix(".png"), results)
    return text


def round_table(results: list[dict]) -> list[str]:
    """Per configuration, level and round: output tok/s, its ratio to nospec's same round, tokens per verify step,
    and the JETFLOW worker's host syncs per round and round split where the server reports them."""
    base = {(r["workload"], r["concurrency"]): r.get("round_tok_per_s") or [] for r in results
            if r["config"] == "nospec"}
    lines = ["", "Per round (rounds run back to back, every configuration once per round, so a round's ratio compares "
             "servers under the same machine state):", "",
             "| workload | config | conc. | round | output tok/s | vs nospec | tokens/verify | host syncs/round | "
             "round split |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r.get("round_tok_per_s") or []
        tpv = r.get("round_tokens_per_verify") or []
        jet = r.get("round_jetflow") or []
        b = base.get((r["workload"], r["concurrency"]), [])
        for i, x in enumerate(tps):
            ratio = f"{x / b[i]:.2f}x" if i < len(b) and b[i] > 0 and r["config"] != "nospec" else "-"
            v = tpv[i] if i < len(tpv) else None
            j = jet[i] if i < len(jet) else {}
            split = j.get("round_split")
            lines.append(f"| {r['workload']} | {r['config']} | {r['concurrency']} | {i + 1} | {x:.1f} | {ratio} | "
                         f"{'-' if v is None else f'{v:.2f}'} | {j.get('host_syncs_per_round', '-')} | "
                         f"{'-' if split is None else json.dumps(split, separators=(',', ':'))} |")
    return lines


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _others(r: dict) -> str:
    cpu = r.get("round_cpu") or []
    if not cpu:
        return "-"
    return f"{max(x['other_servers_cpu_s'] for x in cpu):.1f} / {max(x['foreign_cpu_s'] for x in cpu):.1f}"


def round_ratios(rounds: list[float] | None, base: list[float] | None) -> list[float]:
    """Per-round throughput ratios against nospec's same round (rounds run back to back, so they share the
    machine's state): the spread a user sees from run to run, where the pooled ratio hides it."""
    if not rounds or not base:
        return []
    return [x / b for x, b in zip(rounds, base) if b > 0]


def _plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for cfg in dict.fromkeys(r["config"] for r in results):
            rows = [r for r in results if r["workload"] == w and r["config"] == cfg]
            if rows:
                ax.plot([r["concurrency"] for r in rows], [r["output_tok_per_s"] for r in rows], marker="o", label=cfg)
        ax.set(title=w, xlabel="concurrency", ylabel="output tok/s", xscale="log", xticks=[1, 2, 4, 8])
        ax.set_ylim(bottom=0)  # ratios read true against a zero baseline
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())  # no "3x10^0" labels between levels
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target folder (default: the converted SmolLM2-135M-Instruct)")
    ap.add_argument("--head", help="JetFlow head folder (default: the shipped head)")
    ap.add_argument("--drafter", default=None, help="JETFLOW_DRAFTER (default: jetflow with a head, else ngram)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"default: {' '.join(CONFIGS)} and dflash-bN for every --dflash-blocks N; also "
                         f"{' '.join(EXTRA)}, dflash-bN (SGLang's DFLASH, block N) and jetflow-dflash-bN (JETFLOW "
                         "drafting DFLASH's chain on the same head, lookup off, budget N)")
    ap.add_argument("--dflash-head", help="DFlash release-layout head of the dflash configs (default: an export of "
                                          "the shipped bidirectional head, where it can be exported)")
    ap.add_argument("--dflash-blocks", default="8,16",
                    help="block sizes of the default run's dflash-bN configs, comma-separated (default 8,16; '' for "
                         "none)")
    ap.add_argument("--sets", nargs="+", choices=sorted([*SETS, *LONG_SETS]), default=None,
                    help="one workload per held-out prompt set of ../shared/data instead of the mixed one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prefix-concurrency", type=int, nargs="*", default=[1, 4],
                    help="concurrency levels of the shared-prefix workload (none: skip it)")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run every level this many times (the configurations' order rotating each time); a row "
                         "pools its rounds: throughput = all tokens / all wall time")
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the hardware computes it natively, else float32")
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool size of every server")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every server (OMP_NUM_THREADS). Default 1, the setting of the committed "
                         "runs: with 2 threads on the 2-core machine the tokenizer, detokenizer and HTTP processes "
                         "compete with the OpenMP threads, and neither plain decoding nor JETFLOW got faster")
    ap.add_argument("--burst", type=float, default=0.0,
                    help="seconds of load on every core at the start of every level (default 0: none)")
    ap.add_argument("--max-foreign-cpu", type=float, default=0.25,
                    help="a round whose foreign CPU exceeds this share of one core is run again (default 0.25)")
    ap.add_argument("--retries", type=int, default=2, help="reruns of a round slowed by foreign load (default 2)")
    ap.add_argument("--count-syncs", action="store_true",
                    help="JETFLOW servers count each round's host waits (JETFLOW_COUNT_SYNCS=1, in the report's per-round "
                         "table); its dispatch-level checker slows every round, so timings are off by default")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang_serving"))
    a = ap.parse_args(argv)
    if any(c < 1 for c in a.concurrency + a.prefix_concurrency) or a.requests < 1 or a.max_tokens < 1 \
            or a.threads < 1 or a.rounds < 1:
        ap.error("concurrency, requests, max-tokens, threads and rounds must be >= 1")
    if a.burst < 0 or a.max_foreign_cpu <= 0 or a.retries < 0:
        ap.error("--burst and --retries must be >= 0 and --max-foreign-cpu > 0")
    try:
        blocks = [int(x) for x in a.dflash_blocks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--dflash-blocks must be comma-separated integers; got {a.dflash_blocks!r}")
    if any(not 2 <= n <= 64 for n in blocks):
        ap.error(f"--dflash-blocks must be between 2 and 64; got {a.dflash_blocks!r}")
    explicit = a.configs is not None
    a.configs = list(dict.fromkeys(a.configs if explicit else [*CONFIGS, *(f"dflash-b{n}" for n in blocks)]))
    bad = [c for c in a.configs if c not in CONFIGS + EXTRA and not 2 <= (dflash_block(c) or 0) <= 64
           and not 1 <= (jetflow_budget(c) or 0) <= MAX_BUDGET]
    if bad:
        ap.error(f"unknown config(s) {' '.join(bad)}; choose from {' '.join(CONFIGS + EXTRA)}, jetflow-bN (N in "
                 f"1..{MAX_BUDGET}), dflash-bN, jetflow-dflash-bN (N in 2..64)")

    from transformers import AutoTokenizer

    from jetflow_sglang.paths import default_paths

    from jetflow_sglang.engine.target import resolve_dtype

    dtype = resolve_dtype(a.dtype, "cpu")
    target, shipped = default_paths() if not (a.model and a.head) else (a.model, a.head)
    model = a.model or target
    head = a.head or (shipped if (Path(shipped) / "config.json").is_file() else None)
    drafter = a.drafter or ("jetflow" if head else "ngram")
    failures = {}
    dflash_head, dflash_names = None, [c for c in a.configs if dflash_block(c) is not None]
    if dflash_names:
        try:
            dflash_head, why = dflash_head_dir(a.dflash_head, head, model, Path(tempfile.mkdtemp(prefix="jetflow-bench-")))
        except ValueError as e:
            ap.error(str(e))
        if dflash_head is None and explicit:
            ap.error(f"{' '.join(dflash_names)}: {why}")
        if dflash_head is None:  # the default run goes on without them, and says so in the report
            print(f"warning: {' '.join(dflash_names)} will not run: {why}", file=sys.stderr)
            failures.update({n: f"not started: {why}" for n in dflash_names})
            a.configs = [c for c in a.configs if c not in dflash_names]
    tok = AutoTokenizer.from_pretrained(model)
    mixed = [chat_ids(tok, [{"role": "user", "content": p}]) for p in load_prompts(a.requests)]
    try:
        sets = [(name, [chat_ids(tok, [{"role": "user", "content": p}]) for p in load_set(name, a.requests)],
                 a.concurrency) for name in a.sets or []]
    except FileNotFoundError as e:
        ap.error(str(e))
    sys_text = system_prompt(tok, a.prefix_tokens)
    questions = [json.loads(ln)["prompt"] for ln in (ROOT / "bench" / "data" / "gsm8k.jsonl").read_text().splitlines()]
    shared = [chat_ids(tok, [{"role": "system", "content": sys_text}, {"role": "user", "content": q}])
              for q in (questions * (a.requests // len(questions) + 1))[: a.requests]]
    workloads = (sets or [("mixed", mixed, a.concurrency)]) + ([("shared-prefix", shared, a.prefix_concurrency)]
                                                               if a.prefix_concurrency else [])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    busy = busy_processes(min_cores=a.max_foreign_cpu)  # before any server: a neighbour's load would skew every level
    for b in busy:
        print(f"warning: pid {b['pid']} is using {b['cores']} cores ({b['command']}); the rounds it slows are run "
              f"again (--retries) or flagged in the report. An idle SGLang server started without --sleep-on-idle "
              f"busy-polls a whole core.", file=sys.stderr)
    logs = Path(tempfile.mkdtemp(prefix="jetflow-bench-"))  # server logs stay out of the results folder
    levels = [(wname, prompts, c) for wname, prompts, levels_c in workloads for c in levels_c]
    common = ["--dtype", dtype, "--max-total-tokens", str(a.max_total_tokens),
              "--max-running-requests", str(max(a.concurrency + a.prefix_concurrency))]
    servers = {}  # every configuration's server runs at once (asleep when idle), so each level runs them back to back
    for name in tqdm(a.configs, desc="servers", unit="server"):
        args, env = config_args(name, head, drafter, dflash_head)
        if a.count_syncs and "JETFLOW" in args:
            env = {**env, "JETFLOW_COUNT_SYNCS": "1"}
        srv = Server(model, [*common, *args], logs / f"{name}.log", env={**env, "OMP_NUM_THREADS": str(a.threads)},
                     spawn=True)  # launched as users launch it
        try:
            srv.wait_ready()
            stream_one(srv.url, mixed[0], 4)  # warm-up
            servers[name] = srv
        except (RuntimeError, TimeoutError, requests.RequestException):
            failures[name] = f"did not start: {_last_error(srv.log)}"
            srv.stop()
    bar = tqdm(total=len(servers) * len(levels) * a.rounds, desc="bench", unit="level")
    pooled: dict[tuple[str, str, int], tuple[list[dict], float, dict]] = {}  # (config, workload, c) -> rounds so far
    rounds_tps: dict[tuple[str, str, int], list[float]] = {}  # (config, workload, c) -> output tok/s of each round
    rounds_cpu: dict[tuple[str, str, int], list[dict]] = {}  # (config, workload, c) -> where the CPU went, per round
    discarded: dict[tuple[str, str, int], list[dict]] = {}  # rounds run again because foreign load slowed them
    rounds_tpv: dict[tuple[str, str, int], list] = {}  # (config, workload, c) -> tokens per verify of each round
    rounds_jet: dict[tuple[str, str, int], list[dict]] = {}  # (config, workload, c) -> JETFLOW per-round cost fields
    try:
        for k, (wname, prompts, c) in enumerate(level for _ in range(a.rounds) for level in levels):
            names = [n for n in a.configs if n in servers]
            for name in names[k % len(names):] + names[:k % len(names)] if names else []:  # rotate the order
                bar.set_postfix_str(f"{name} {wname} c={c}")
                srv = servers.get(name)
                if srv is None:  # died at an earlier level
                    bar.update(1)
                    continue
                try:
                    for attempt in range(a.retries + 1):
                        srv.flush_cache()  # every level starts cold
                        cpu0 = cpu_snapshot(servers)
                        burst = Burst(a.burst)
                        recs, wall = run_level(srv, prompts, c, a.max_tokens)
                        burst.join()
                        cpu = {**cpu_during(cpu0, cpu_snapshot(servers), name), "wall_s": round(wall, 2)}
                        if cpu["foreign_cpu_s"] <= a.max_foreign_cpu * wall or attempt == a.retries:
                            break
                        discarded.setdefault((name, wname, c), []).append(
                            {"tok_per_s": round(sum(x["tokens"] for x in recs) / wall, 3), **cpu})
                    rounds_cpu.setdefault((name, wname, c), []).append(cpu)
                    old_recs, old_wall, _ = pooled.get((name, wname, c), ([], 0.0, {}))
                    state = server_state(srv)
                    pooled[(name, wname, c)] = (old_recs + recs, old_wall + wall, state)
                    rounds_tps.setdefault((name, wname, c), []).append(sum(x["tokens"] for x in recs) / wall)
                    rounds_tpv.setdefault((name, wname, c), []).append(tokens_per_verify(recs))
                    rounds_jet.setdefault((name, wname, c), []).append(jetflow_round_fields(state))
                except requests.RequestException as e:  # the server died mid-run: say why, keep the others
                    failures[name] = f"{type(e).__name__} at {wname} c={c}; server: {_last_error(srv.log)}"
                    servers.pop(name).stop()
                bar.update(1)
    finally:
        for srv in servers.values():
            srv.stop()
    per_round = {wname: len(prompts) for wname, prompts, _ in workloads}
    results = [{"config": name, "workload": wname, "rounds": len(recs) // per_round[wname],
                **summarize(c, recs, wall), "round_tok_per_s": [round(x, 3) for x in rounds_tps[(name, wname, c)]],
                "round_cpu": rounds_cpu.get((name, wname, c), []),
                "discarded_rounds": discarded.get((name, wname, c), []),
                "round_tokens_per_verify": rounds_tpv.get((name, wname, c), []),
                **({"round_jetflow": rounds_jet[(name, wname, c)]} if any(rounds_jet.get((name, wname, c), [])) else {}),
                "server": state}
               for (name, wname, c), (recs, wall, state) in pooled.items()]
    for r in results:  # each round against nospec's same round (also in the report's per-round table)
        base = next((b.get("round_tok_per_s") for b in results if b["config"] == "nospec"
                     and (b["workload"], b["concurrency"]) == (r["workload"], r["concurrency"])), None)
        if r["config"] != "nospec" and base:
            r["round_vs_nospec"] = [round(x, 3) for x in round_ratios(r["round_tok_per_s"], base)]
    order = {n: i for i, n in enumerate(a.configs)}
    worder = {w: i for i, (w, _, _) in enumerate(workloads)}
    results.sort(key=lambda r: (worder[r["workload"]], order[r["config"]], r["concurrency"]))
    bar.close()
    meta = {"command": " ".join(["python", "scripts/bench_serving.py", *(argv if argv is not None else sys.argv[1:])]),
            "model": model, "head": head, "drafter": drafter, "dtype": dtype, "max_tokens": a.max_tokens,
            "dflash_head": dflash_head, "dflash_blocks": sorted({dflash_block(c) for c in dflash_names}),
            "requests_per_level": a.requests, "workloads": (
                "held-out sets of ../shared/data, one workload each: " + ", ".join(a.sets) if a.sets
                else "GSM8K + MT-Bench chat prompts"), "rounds": a.rounds, "prefix_tokens": a.prefix_tokens, "threads": a.threads,
            "burst_s": a.burst, "max_foreign_cpu": a.max_foreign_cpu, "retries": a.retries, "busy_at_start": busy,
            "machine": f"{cpu_model()} ({bf16_isa()}), {platform.machine()}, {os.cpu_count()} cores",
            "sglang": _version("sglang"), "torch": _version("torch"), "date": time.strftime("%Y-%m-%d %H:%M")}
    print(write_report(out, meta, results, failures))
    return 0


def _last_error(log: Path) -> str:
    """The exception line of a server log (e.g. 'NotImplementedError: ...'), else its last line mentioning an error."""
    import re

    lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines()]
    exc = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    other = [ln for ln in lines if "rror" in ln and "Ignore import error" not in ln and "server_args=" not in ln
             and "Pyspy" not in ln and "coredump" not in ln]
    pick = (exc or other or ["no error in the log"])[-1]
    return pick[:300] + f" (log: {log})"


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


if __name__ == "__main__":
    sys.exit(main())
