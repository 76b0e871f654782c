"""Soak benchmark: N mixed requests (default 300) at concurrency 8 against a JETFLOW server (JETFLOW_BUDGET=auto) and
a plain SGLang server (no speculation) on the same target, both float32 on the CPU, one server after the other (only
one is up at a time unless --together; each is warmed up first, see warm_up).

The mix (request i is built from --seed and i alone, so both servers get the very same list): greedy and sampled
requests on /generate, /v1/completions and /v1/chat/completions (some OpenAI ones without a temperature, i.e. 1.0),
streaming, logprobs (return_logprob + top_logprobs_num, prompt logprobs; OpenAI logprobs / top_logprobs), regex and
JSON-schema constrained decoding (`regex`, `json_schema`; `response_format`), frequency / presence / repetition
penalties, stop strings, n=2, aborts (POST /abort_request with the rid while the request runs) and dropped clients (a
streaming client that closes its connection after a few chunks).

It reports
  errors          any non-2xx, exception, malformed answer (missing logprobs, a finished regex / JSON output that
                  does not parse), the server process dying, /health not 200 at the end. Must be 0.
  memory          the server's RSS (whole process tree, psutil) and the JETFLOW head-pool usage (/server_info ->
                  internal_states[0].jetflow.head_pool_used) at start, middle and end, and after POST /flush_cache:
                  the head pool must be back to its baseline then.
  greedy identity every greedy request (not aborted, not dropped) gives the same output on both servers.
The plain server runs with --disable-overlap-schedule, as the JETFLOW worker does (SGLang's overlap scheduler applies
penalties one token late, so a greedy request with penalties would differ for that reason alone). Results:
<out>.json, <out>.md and <out>.png (RSS and head-pool usage over the run). Exit status 0 iff everything passed.

    python scripts/soak_server.py                        # SmolLM2-135M-Instruct + shipped head, 300 requests, conc. 8
    python scripts/soak_server.py --requests 40 --target T --head H --out /tmp/soak
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests" / "sglang", ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from bench_serving import _last_error, _version, config_args, load_prompts  # noqa: E402
from sgl_server import Server  # noqa: E402

from jetflow_sglang.machine import bf16_isa, cpu_model  # noqa: E402

REGEXES = [r"[0-9]{1,4}(, [0-9]{1,4}){0,3}\.", r"(yes|no|maybe), because [a-z ]{1,30}\.",
           r"[A-Z][a-z]{1,8}( [a-z]{1,8}){1,4}\."]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"},
                                           "unit": {"type": "string", "enum": ["apples", "dollars", "hours", "none"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "unit", "sure"], "additionalProperties": False}
STOPS = [".", "\n", " the", "?", ",", ":"]
PENALTIES = [{"frequency_penalty": 0.8}, {"presence_penalty": 0.6}, {"repetition_penalty": 1.3},
             {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}]


# -- the request mix ---------------------------------------------------------------------------------------------
def _sampled(rng) -> dict:
    sp = {"temperature": round(rng.uniform(0.5, 1.2), 2), "top_p": rng.choice([1.0, 0.9, 0.8])}
    if rng.random() < 0.5:
        sp["top_k"] = rng.choice([5, 20, 50])
    return sp


def _generate(prompt, mnt, sp, **top) -> tuple[str, dict]:
    return "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": mnt, **sp}, **top}


def _chat_body(prompt, mnt, **kw) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": mnt, **kw}


def _k_generate_greedy(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0, **({"ignore_eos": True} if rng.random() < 0.3 else {})})


def _k_generate_sampled(rng, p, mnt):
    extra = {"sampling_seed": rng.randrange(1000)} if rng.random() < 0.5 else {}
    return _generate(p, mnt, {**_sampled(rng), **extra})


def _k_stream_greedy(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0}, stream=True)


def _k_stream_sampled(rng, p, mnt):
    return _generate(p, mnt, _sampled(rng), stream=True)


def _k_logprobs_greedy(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0}, return_logprob=True, top_logprobs_num=rng.choice([1, 3, 5]),
                     logprob_start_len=rng.choice([-1, 0]))


def _k_logprobs_sampled_stream(rng, p, mnt):
    return _generate(p, mnt, _sampled(rng), return_logprob=True, top_logprobs_num=2, stream=True)


def _k_regex(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0, "regex": rng.choice(REGEXES)})


def _k_json(rng, p, mnt):
    return _generate(p, max(mnt, 24), {"temperature": 0, "json_schema": json.dumps(SCHEMA)})


def _k_penalties_greedy(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0, **rng.choice(PENALTIES)})


def _k_penalties_sampled(rng, p, mnt):
    return _generate(p, mnt, {**_sampled(rng), **rng.choice(PENALTIES)})


def _k_stop(rng, p, mnt):
    return _generate(p, mnt, {"temperature": 0, "stop": rng.sample(STOPS, 2)})


def _k_generate_n2(rng, p, mnt):
    return _generate(p, mnt, {**_sampled(rng), "n": 2})


def _k_completions_greedy(rng, p, mnt):
    kw = {"logprobs": rng.choice([1, 3])} if rng.random() < 0.5 else {"stop": rng.sample(STOPS, 1)}
    if rng.random() < 0.3:
        kw.update(rng.choice(PENALTIES))
    return "/v1/completions", {"model": "default", "prompt": p, "max_tokens": mnt, "temperature": 0, **kw}


def _k_completions_default_temp(rng, p, mnt):  # no temperature: 1.0
    return "/v1/completions", {"model": "default", "prompt": p, "max_tokens": mnt,
                               **({"n": 2} if rng.random() < 0.5 else {"logprobs": 2})}


def _k_completions_stream(rng, p, mnt):
    return "/v1/completions", {"model": "default", "prompt": p, "max_tokens": mnt, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}}


def _k_completions_regex(rng, p, mnt):  # SGLang's extension
    return "/v1/completions", {"model": "default", "prompt": p, "max_tokens": mnt, "temperature": 0,
                               "regex": rng.choice(REGEXES)}


def _k_chat_greedy(rng, p, mnt):
    return "/v1/chat/completions", _chat_body(p, mnt, temperature=0, logprobs=True, top_logprobs=rng.choice([1, 2]))


def _k_chat_default_temp(rng, p, mnt):  # no temperature: 1.0
    return "/v1/chat/completions", _chat_body(p, mnt, **({"top_p": 0.9} if rng.random() < 0.5 else {}))


def _k_chat_stream_sampled(rng, p, mnt):
    pen = {"frequency_penalty": 0.5} if rng.random() < 0.5 else {}
    return "/v1/chat/completions", _chat_body(p, mnt, temperature=0.8, stream=True,
                                              stream_options={"include_usage": True}, **pen)


def _k_chat_stream_greedy(rng, p, mnt):
    return "/v1/chat/completions", _chat_body(p, mnt, temperature=0, stream=True, stop=rng.sample(STOPS, 1))


def _k_chat_json(rng, p, mnt):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return "/v1/chat/completions", _chat_body(p, max(mnt, 24), temperature=0, response_format=fmt)


def _k_chat_n2_greedy(rng, p, mnt):
    return "/v1/chat/completions", _chat_body(p, mnt, temperature=0, n=2)


def _k_abort(rng, p, mnt):  # long, then POST /abort_request while it runs
    route, body = _generate(p, 4 * mnt, {"temperature": rng.choice([0, 0.8]), "ignore_eos": True},
                            stream=rng.random() < 0.5)
    return route, body, {"abort_after": round(rng.uniform(0.2, 2.0), 2)}


def _k_drop(rng, p, mnt):  # a streaming client that goes away after a few chunks
    if rng.random() < 0.5:
        route, body = _generate(p, 4 * mnt, {"temperature": rng.choice([0, 0.8]), "ignore_eos": True}, stream=True)
    else:
        route, body = "/v1/chat/completions", _chat_body(p, 4 * mnt, temperature=0.7, stream=True)
    return route, body, {"drop_after": rng.randint(1, 4)}


KINDS = {name[3:]: fn for name, fn in globals().items() if name.startswith("_k_")}


def build_requests(n: int, seed: int, prompts: list[str], max_new: int) -> list[dict]:
    """Request i: a kind (every kind once per block of len(KINDS), in a seeded order), a prompt, a length and the
    kind's parameters, all from (seed, i) alone."""
    names = sorted(KINDS)
    out = []
    for i in range(n):
        block, pos = divmod(i, len(names))
        order = names[:]
        random.Random(f"{seed}/block/{block}").shuffle(order)
        kind = order[pos]
        rng = random.Random(f"{seed}/{i}")
        prompt = rng.choice(prompts)
        built = KINDS[kind](rng, prompt, rng.randint(max(4, max_new // 4), max_new))
        route, body, extra = built if len(built) == 3 else (*built, {})
        sp = body.get("sampling_params", body)
        greedy = sp.get("temperature", 1.0) == 0 and not extra
        # plain SGLang orders repetition against frequency/presence penalties by a set's iteration order, which
        # changes between launches (docs/SGLANG_RECORD.md, Penalties): such a request has no single plain answer
        additive = sp.get("frequency_penalty") or sp.get("presence_penalty")
        mixed = sp.get("repetition_penalty", 1.0) != 1.0 and bool(additive)
        out.append({"i": i, "kind": kind, "route": route, "body": body, "stream": bool(body.get("stream")),
                    "abort_after": extra.get("abort_after"), "drop_after": extra.get("drop_after"),
                    "greedy": greedy, "compare": greedy and not mixed})
    return out


# -- sending one request and checking its answer ----------------------------------------------------------------
def _finish_type(fr) -> str | None:
    return fr.get("type") if isinstance(fr, dict) else fr


def _check_generate(req: dict, item: dict) -> str | None:
    """A problem with a non-streamed /generate answer, or None."""
    body, sp, meta = req["body"], req["body"]["sampling_params"], item.get("meta_info", {})
    fin = _finish_type(meta.get("finish_reason"))
    if "text" not in item or "output_ids" not in item:
        return f"no text/output_ids in {sorted(item)}"
    if body.get("return_logprob") and fin != "abort":
        lp, top = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if lp is None or len(lp) != len(item["output_ids"]):
            return f"output_token_logprobs: {None if lp is None else len(lp)} for {len(item['output_ids'])} tokens"
        if top is None or any(len(t) != body["top_logprobs_num"] for t in top):
            return f"output_top_logprobs not {body['top_logprobs_num']} per token"
        if body.get("logprob_start_len") == 0 and len(meta.get("input_token_logprobs") or []) != meta.get(
                "prompt_tokens"):
            return f"input_token_logprobs: {len(meta.get('input_token_logprobs') or [])} for " \
                   f"{meta.get('prompt_tokens')} prompt tokens"
    if fin == "stop":
        return _check_constrained(sp.get("regex"), sp.get("json_schema") is not None, item["text"])
    return None


def _check_constrained(regex, is_json: bool, text: str) -> str | None:
    if regex and not re.fullmatch(regex, text):
        return f"finished output {text!r} does not match {regex!r}"
    if is_json:
        try:
            obj = json.loads(text)
        except ValueError:
            return f"finished output {text!r} is not JSON"
        if not isinstance(obj, dict) or set(obj) != set(SCHEMA["required"]):
            return f"finished output {text!r} does not follow the schema"
    return None


def _check_openai(req: dict, choices: list[dict]) -> str | None:
    body = req["body"]
    if len(choices) != body.get("n", 1):
        return f"{len(choices)} choices for n={body.get('n', 1)}"
    for c in choices:
        if c.get("finish_reason") == "abort":
            continue
        lp = c.get("logprobs")
        if body.get("logprobs") and not body.get("stream"):
            if req["route"] == "/v1/completions":
                if not lp or (c["text"] and not lp.get("tokens")) or \
                        any(len(t) < 1 for t in (lp.get("top_logprobs") or [{}])):
                    return f"completion logprobs missing: {str(lp)[:200]}"
            elif not lp or (c["message"]["content"] and not lp.get("content")) or \
                    any(len(t.get("top_logprobs", [])) != body["top_logprobs"] for t in lp.get("content") or []):
                return f"chat logprobs missing or not top_logprobs={body['top_logprobs']}: {str(lp)[:200]}"
        if c.get("finish_reason") == "stop":
            rf = body.get("response_format")
            text = c["text"] if "text" in c else c["message"]["content"]
            bad = _check_constrained(body.get("regex"), bool(rf), text or "")
            if bad:
                return bad
    return None


def _sse(resp):
    """The JSON payloads of a server-sent-event response, up to [DONE]."""
    for line in resp.iter_lines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def send(url: str, req: dict, rid: str, timeout: float) -> dict:
    """Send one request (abort it / drop the connection if it is meant to be): its record."""
    body = dict(req["body"])
    rec = {"i": req["i"], "kind": req["kind"], "status": None, "error": None, "texts": None, "ids": None,
           "finish": None, "tokens": 0, "aborted": False, "dropped": False}
    openai = req["route"] != "/generate"
    if req["abort_after"] is not None:
        body["rid"] = rid
        abort_status = []

        def _abort():
            try:
                abort_status.append(requests.post(url + "/abort_request", json={"rid": rid}, timeout=60).status_code)
            except requests.RequestException as e:
                abort_status.append(f"{type(e).__name__}: {e}"[:200])

        timer = threading.Timer(req["abort_after"], _abort)
        timer.start()
    t0 = time.perf_counter()
    try:
        with requests.post(url + req["route"], json=body, stream=req["stream"], timeout=timeout) as r:
            rec["status"] = r.status_code
            if not 200 <= r.status_code < 300:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                return rec
            if not req["stream"]:
                data = r.json()
                if openai:
                    choices = sorted(data["choices"], key=lambda c: c["index"])
                    rec["texts"] = [c["text"] if "text" in c else c["message"]["content"] for c in choices]
                    rec["finish"] = [c.get("finish_reason") for c in choices]
                    rec["tokens"] = data.get("usage", {}).get("completion_tokens", 0)
                    rec["error"] = _check_openai(req, choices)
                else:
                    items = data if isinstance(data, list) else [data]
                    rec["texts"] = [x.get("text") for x in items]
                    rec["ids"] = [x.get("output_ids") for x in items]
                    rec["finish"] = [_finish_type(x.get("meta_info", {}).get("finish_reason")) for x in items]
                    rec["tokens"] = sum(x.get("meta_info", {}).get("completion_tokens", 0) for x in items)
                    rec["error"] = next((e for e in (_check_generate(req, x) for x in items) if e), None)
            else:
                texts, finish, chunks = {}, {}, 0
                for ev in _sse(r):
                    if "error" in ev:
                        rec["error"] = f"error event: {str(ev['error'])[:300]}"
                        return rec
                    chunks += 1
                    if openai:
                        for c in ev.get("choices", []):
                            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                            if c.get("finish_reason"):
                                finish[c["index"]] = c["finish_reason"]
                        if ev.get("usage"):
                            rec["tokens"] = ev["usage"].get("completion_tokens", 0)
                    else:  # /generate streams the whole text so far
                        texts[ev.get("index", 0)] = ev.get("text", "")
                        meta = ev.get("meta_info", {})
                        finish[ev.get("index", 0)] = _finish_type(meta.get("finish_reason"))
                        rec["tokens"] = meta.get("completion_tokens", rec["tokens"])
                    if req["drop_after"] is not None and chunks >= req["drop_after"]:
                        rec["dropped"] = True
                        break  # leaving the `with` closes the connection mid-stream
                rec["texts"] = [texts.get(k, "") for k in sorted(texts)] or [""]
                rec["finish"] = [finish.get(k) for k in sorted(texts)] or [None]
                if not rec["dropped"] and openai:
                    rec["error"] = _check_openai(req, [{"index": k, "text": v, "finish_reason": finish.get(k)}
                                                       for k, v in sorted(texts.items())])
                elif not rec["dropped"] and req["abort_after"] is None and finish.get(0) == "stop":
                    sp = req["body"]["sampling_params"]
                    rec["error"] = _check_constrained(sp.get("regex"), sp.get("json_schema") is not None,
                                                      rec["texts"][0])
    except Exception as e:  # noqa: BLE001 - every failure is counted, whatever it is
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        rec["latency_s"] = round(time.perf_counter() - t0, 3)
        if req["abort_after"] is not None:
            timer.join()
            rec["aborted"] = "abort" in (rec["finish"] or [])
            if abort_status and abort_status[0] != 200 and rec["error"] is None:
                rec["error"] = f"/abort_request answered {abort_status[0]}"
    return rec


# -- server state ------------------------------------------------------------------------------------------------
def rss_mib(srv: Server) -> float | None:
    import psutil

    try:
        root = psutil.Process(srv.proc.pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:  # and zombies
            pass
    return round(total / 2**20, 1) if total else None


def jetflow_state(srv: Server) -> dict | None:
    """internal_states[0]['jetflow'] of /server_info (or /get_server_info), None for a server without it."""
    for path in ("/server_info", "/get_server_info"):
        try:
            r = requests.get(srv.url + path, timeout=60)
            if r.ok:
                return r.json()["internal_states"][0].get("jetflow")
        except (requests.RequestException, KeyError, IndexError, ValueError):
            continue
    return None


def checkpoint(name: str, srv: Server, t0: float) -> dict:
    st = jetflow_state(srv) or {}
    return {"at": name, "t_s": round(time.monotonic() - t0, 1), "rss_mib": rss_mib(srv),
            "head_pool_used": st.get("head_pool_used"), "head_pool_slots": st.get("head_pool_slots"),
            "head_pool_bytes": st.get("head_pool_bytes")}


class Sampler(threading.Thread):
    """Every `every` s: RSS and (JETFLOW) head-pool usage of the server under test (`current`: (name, Server))."""

    def __init__(self, t0: float, every: float):
        super().__init__(daemon=True)
        self.t0, self.every, self.current = t0, every, None
        self.samples, self._stop_ev = [], threading.Event()

    def run(self):
        while not self._stop_ev.wait(self.every):
            cur = self.current
            if cur is not None:
                name, srv = cur
                pool = (jetflow_state(srv) or {}).get("head_pool_used") if name == "jetflow" else None
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 1), "server": name,
                                     "rss_mib": rss_mib(srv), "head_pool_used": pool})

    def stop(self):
        self._stop_ev.set()
        self.join(timeout=120)


# -- one server's soak -------------------------------------------------------------------------------------------
def warm_up(srv: Server) -> float:
    """A few short requests before the baseline, so that one-time costs stay out of the soak: SGLang compiles its
    repetition penalty and its seeded sampling (`apply_scaling_penalties`, `multinomial_with_seed`: torch.compile)
    on the first request that uses them, which stops the whole scheduler for ~1 minute on a CPU; batch 1 and
    batches > 1 compile separately. Seconds taken."""
    t = time.monotonic()

    def body(k: int) -> dict:
        sp = {"max_new_tokens": 6, "temperature": 0, "repetition_penalty": 1.2}
        return {"text": f"Warm up number {k}.", "sampling_params": sp if k % 2 == 0 else
                {**sp, "temperature": 0.7, "sampling_seed": k}}

    for k in (0, 1):
        srv.generate(timeout=900, **body(k))
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: srv.generate(timeout=900, **body(k)), range(2, 6)))
    return round(time.monotonic() - t, 1)


def run_phase(name: str, srv: Server, reqs: list[dict], concurrency: int, deadline: float, t0: float) -> dict:
    errors = []
    if not srv.flush_cache(timeout=120):  # the baseline: an empty radix cache
        errors.append({"server": name, "i": None, "kind": "flush", "error": "POST /flush_cache refused at start"})
    points = [checkpoint("start", srv, t0)]
    records, half, middle = {}, (len(reqs) + 1) // 2, False

    def one(req):
        if time.monotonic() > deadline:
            return None  # out of time: not sent
        return send(srv.url, req, f"soak-{name}-{req['i']}-{time.time_ns()}",
                    timeout=max(60.0, deadline - time.monotonic() + 300))

    started = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool, tqdm(total=len(reqs), desc=name, unit="req") as bar:
        futs = [pool.submit(one, r) for r in reqs]
        for fut in cf.as_completed(futs):
            rec = fut.result()
            if rec is not None:
                records[rec["i"]] = rec
                if rec["error"]:
                    errors.append({"server": name, "i": rec["i"], "kind": rec["kind"], "error": rec["error"]})
                    tqdm.write(f"ERROR {name} request {rec['i']} ({rec['kind']}): {rec['error']}")
            if len(records) >= half and not middle:
                middle = True
                points.append(checkpoint("middle", srv, t0))
            bar.update(1)
            bar.set_postfix(errors=len(errors))
    wall = time.monotonic() - started
    points.append(checkpoint("end", srv, t0))
    try:
        if not srv.flush_cache(timeout=120):
            errors.append({"server": name, "i": None, "kind": "flush", "error": "POST /flush_cache refused for 120 s"})
    except requests.RequestException as e:
        errors.append({"server": name, "i": None, "kind": "flush", "error": f"POST /flush_cache: {type(e).__name__}"})
    points.append(checkpoint("after_flush", srv, t0))
    if srv.proc.poll() is not None:
        errors.append({"server": name, "i": None, "kind": "process",
                       "error": f"the server exited ({srv.proc.returncode}); {_last_error(srv.log)}"})
    try:
        health = requests.get(srv.url + "/health", timeout=30).status_code
    except requests.RequestException as e:
        health = f"{type(e).__name__}"
    if health != 200:
        errors.append({"server": name, "i": None, "kind": "health", "error": f"/health at the end: {health}"})
    base, after = points[0]["head_pool_used"], points[-1]["head_pool_used"]
    return {"records": records, "errors": errors, "checkpoints": points, "wall_s": round(wall, 1),
            "sent": len(records), "output_tokens": sum(r["tokens"] or 0 for r in records.values()),
            "health": health, "pool_back_to_baseline": None if base is None else after == base}


def compare_greedy(reqs: list[dict], a: dict, b: dict) -> tuple[int, list[dict]]:
    """(greedy requests compared, mismatches): outputs (and token ids where /generate returns them) and finish
    reasons of every greedy request that both servers answered without error, abort or drop, except those mixing
    repetition with frequency/presence penalties (build_requests)."""
    n, bad = 0, []
    for req in reqs:
        x, y = a.get(req["i"]), b.get(req["i"])
        if not req["compare"] or x is None or y is None or x["error"] or y["error"]:
            continue
        n += 1
        if (x["texts"], x["ids"], x["finish"]) != (y["texts"], y["ids"], y["finish"]):
            bad.append({"i": req["i"], "kind": req["kind"], "route": req["route"], "body": req["body"],
                        "jetflow": {k: x[k] for k in ("texts", "ids", "finish")},
                        "plain": {k: y[k] for k in ("texts", "ids", "finish")}})
    return n, bad


# -- report ------------------------------------------------------------------------------------------------------
def write_report(out: Path, result: dict) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    m, ph = result["meta"], result["phases"]
    ok = "PASS" if result["passed"] else "FAIL"
    lines = [f"# Soak: JETFLOW (auto) vs plain SGLang, {m['requests']} mixed requests ({m['date']}): {ok}", "",
             f"Command: `{m['command']}`", "",
             f"target `{m['target']}`, head `{m['head']}`, float32, CPU, concurrency {m['concurrency']}, max new "
             f"tokens {m['max_new_tokens']} (aborted / dropped requests: 4x), seed {m['seed']}; JETFLOW: "
             f"`{' '.join(m['jetflow_args'])}` with {m['jetflow_env']}; plain: `{' '.join(m['plain_args'])}`; "
             f"{m['threads']} torch thread(s) per server; machine: {m['machine']}; sglang {m['sglang']}, torch "
             f"{m['torch']}.", "",
             f"- errors: **{len(result['errors'])}**",
             f"- greedy identity: **{result['greedy_compared'] - len(result['greedy_mismatches'])} / "
             f"{result['greedy_compared']}** greedy requests identical",
             "- JETFLOW head pool back to its baseline after /flush_cache: "
             f"**{ph.get('jetflow', {}).get('pool_back_to_baseline')}**"]
    if result.get("warm_up_s"):
        lines.append(f"- warm-up before the baseline (s): {result['warm_up_s']} (SGLang compiles its repetition "
                     f"penalty and seeded sampling with torch.compile on first use, a scheduler stop of ~1 min on a "
                     f"CPU)")
    if result.get("start_s"):
        lines.append(f"- server start (s): {result['start_s']}")
    if result.get("truncated"):
        lines.append(f"- **stopped by --max-minutes**: {result['truncated']}")
    lines += ["", "| server | requests | wall (s) | output tokens | tok/s | aborted | dropped | errors |",
              "|---|---|---|---|---|---|---|---|"]
    for name, p in ph.items():
        recs = p["records"].values()
        lines.append(f"| {name} | {p['sent']} | {p['wall_s']} | {p['output_tokens']} | "
                     f"{p['output_tokens'] / max(p['wall_s'], 1e-9):.1f} | {sum(r['aborted'] for r in recs)} | "
                     f"{sum(r['dropped'] for r in recs)} | {sum(e['server'] == name for e in result['errors'])} |")
    lines += ["", "Memory (RSS: the server's whole process tree; head pool: head rows in use, JETFLOW only):", "",
              "| server | checkpoint | t (s) | RSS (MiB) | head pool used |", "|---|---|---|---|---|"]
    for name, p in ph.items():
        for c in p["checkpoints"]:
            pool = "-" if c["head_pool_used"] is None else c["head_pool_used"]
            lines.append(f"| {name} | {c['at']} | {c['t_s']} | {c['rss_mib']} | {pool} |")
    lines += ["", "The mix (requests per kind; `greedy` ones are compared between the servers):", "",
              "| kind | route | requests | greedy |", "|---|---|---|---|"]
    for kind, row in result["mix"].items():
        lines.append(f"| {kind} | {row['route']} | {row['count']} | {'yes' if row['greedy'] else 'no'} |")
    if result["errors"]:
        lines += ["", "## Errors", "", "| server | request | kind | error |", "|---|---|---|---|"]
        for e in result["errors"]:
            lines.append(f"| {e['server']} | {e['i']} | {e['kind']} | {str(e['error']).replace('|', '/')[:300]} |")
    if result["greedy_mismatches"]:
        lines += ["", "## Greedy mismatches", ""]
        for x in result["greedy_mismatches"]:
            lines += [f"- request {x['i']} ({x['kind']}, {x['route']}): JETFLOW {x['jetflow']['texts']!r} "
                      f"({x['jetflow']['finish']}) vs plain {x['plain']['texts']!r} ({x['plain']['finish']})"]
    for name, kern in result.get("kernel_log", {}).items():
        lines += ["", f"The {name} server died; the kernel's last OOM-killer lines:", "", "```", *kern, "```"]
    for name, errs in result.get("server_log_errors", {}).items():
        if errs:
            lines += ["", f"Error lines in the {name} server log:", "", "```", *errs[-20:], "```"]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    _plot(out.with_suffix(".png"), result)
    return text


def _plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name in result["phases"]:
        s = [x for x in result["samples"] if x["server"] == name and x["rss_mib"] is not None]
        ax1.plot([x["t_s"] / 60 for x in s], [x["rss_mib"] for x in s], label=name)
        pts = [c for c in result["phases"][name]["checkpoints"] if c["rss_mib"] is not None]
        ax1.scatter([c["t_s"] / 60 for c in pts], [c["rss_mib"] for c in pts], s=14)
        p = [x for x in result["samples"] if x["server"] == name and x["head_pool_used"] is not None]
        p += [{"t_s": c["t_s"], "head_pool_used": c["head_pool_used"]}
              for c in result["phases"][name]["checkpoints"] if c["head_pool_used"] is not None]
        if p:
            p.sort(key=lambda x: x["t_s"])
            ax2.plot([x["t_s"] / 60 for x in p], [x["head_pool_used"] for x in p], label=f"{name} head pool",
                     marker=".")
    for name, ph in result["phases"].items():  # each server's soak, shaded
        cps = ph["checkpoints"]
        if cps:
            for ax in (ax1, ax2):
                ax.axvspan(cps[0]["t_s"] / 60, cps[-1]["t_s"] / 60, alpha=0.08,
                           color="tab:blue" if name == "jetflow" else "tab:orange")
    ax1.set(ylabel="server RSS (MiB)", title=f"soak: {result['meta']['requests']} requests, "
                                             f"concurrency {result['meta']['concurrency']} (dots: checkpoints)")
    ax2.set(xlabel="minutes since start", ylabel="head rows in use")
    rss = [x["rss_mib"] for x in result["samples"] if x["rss_mib"]]
    ax1.set_ylim(0, 1.15 * max(rss) if rss else None)
    slots = [c["head_pool_slots"] for c in result["phases"].get("jetflow", {}).get("checkpoints", [])
             if c.get("head_pool_slots")]
    if slots:  # the pool's size (= the KV pool's): a full radix cache evicts below it
        ax2.axhline(slots[0], color="grey", linestyle="--", linewidth=1, label="head pool size")
    ax2.set_ylim(0, 1.1 * max([*slots, *(x["head_pool_used"] or 0 for x in result["samples"]), 1]))
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_errors(log: Path) -> list[str]:
    """The server log's lines about errors and crashes, up to the SIGTERM that stops it."""
    keep = []
    for ln in Path(log).read_text(errors="replace").splitlines():
        if "SIGTERM received" in ln:
            break
        if re.search(r"Traceback|\b\w*(Error|Exception)\b|crashed|Killed|SIGQUIT|SIGKILL", ln) \
                and "Ignore import error" not in ln and "server_args=" not in ln and "Client disconnected" not in ln:
            keep.append(ln.strip()[:400])
    return keep


def _oom_lines() -> list[str]:
    """The kernel's last OOM-killer lines (a server that died may have been killed for the machine's memory)."""
    import subprocess

    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip()[:400] for ln in out.splitlines() if "Out of memory" in ln or "oom-kill:" in ln][-6:]


# -- main --------------------------------------------------------------------------------------------------------
_LIVE: list[Server] = []  # the servers of the run under way, for SIGTERM


def _on_term(*_):
    """SIGTERM: kill both servers' process groups now (in-flight requests then fail fast), then unwind."""
    for srv in _LIVE:
        try:
            os.killpg(srv.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    sys.exit(143)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target folder (default: the converted SmolLM2-135M-Instruct)")
    ap.add_argument("--head", help="JetFlow head folder (default: the shipped head)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="longest answer (aborted/dropped ones: 4x)")
    ap.add_argument("--max-prompt-chars", type=int, default=0, help="cut prompts to this many characters (0: no cut)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=30.0,
                    help="time bound of the whole run; requests not sent by then are skipped (and reported)")
    ap.add_argument("--max-total-tokens", type=int, default=8192,
                    help="KV pool size of each server (small enough that the radix cache evicts during the run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server (OMP_NUM_THREADS)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS / head-pool samples")
    ap.add_argument("--together", action="store_true",
                    help="start both servers at once (faster; twice the memory while the first one's soak runs)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="JETFLOW on SGLang's overlap scheduler (JETFLOW_OVERLAP; auto: synchronous on a CPU)")
    ap.add_argument("--plain-from", metavar="JSON",
                    help="take the plain server's phase from an earlier run's JSON (the same target, requests, seed, "
                         "token and prompt limits, pool and concurrency) instead of starting a plain server")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"))
    a = ap.parse_args(argv)
    if min(a.requests, a.concurrency, a.max_new_tokens, a.threads) < 1 or a.max_minutes <= 0:
        ap.error("requests, concurrency, max-new-tokens, threads and max-minutes must be positive")
    t0 = time.monotonic()
    deadline = t0 + 60 * a.max_minutes
    old_term = signal.signal(signal.SIGTERM, _on_term)
    try:
        return _run(a, argv, t0, deadline)
    finally:
        signal.signal(signal.SIGTERM, old_term)


SAME_RUN = ("target", "requests", "concurrency", "max_new_tokens", "max_prompt_chars", "seed", "max_total_tokens",
            "plain_args")  # what an earlier run must share for its plain phase to stand in (--plain-from)


def _saved_plain_phase(a, target, plain_args) -> dict:
    """The plain phase of the run in a.plain_from, its records keyed by request index again; SystemExit naming the
    first setting that differs."""
    saved = json.loads(Path(a.plain_from).read_text())
    want = {"target": str(target), "requests": a.requests, "concurrency": a.concurrency,
            "max_new_tokens": a.max_new_tokens, "max_prompt_chars": a.max_prompt_chars, "seed": a.seed,
            "max_total_tokens": a.max_total_tokens, "plain_args": plain_args}
    for key in SAME_RUN:
        if saved.get("meta", {}).get(key) != want[key]:
            raise SystemExit(f"error: --plain-from {a.plain_from}: {key} is {saved.get('meta', {}).get(key)!r} there, "
                             f"{want[key]!r} here")
    phase = saved.get("phases", {}).get("plain")
    if phase is None or saved.get("truncated"):
        raise SystemExit(f"error: --plain-from {a.plain_from}: that run has no complete plain phase")
    return {**phase, "records": {int(k): v for k, v in phase["records"].items()}}


def _run(a, argv, t0: float, deadline: float) -> int:
    from jetflow_sglang.paths import default_paths

    if a.target and a.head:
        target, head = a.target, a.head
    else:
        dt, dh = default_paths()
        target, head = a.target or dt, a.head or dh
    prompts = load_prompts(80)
    if a.max_prompt_chars:
        prompts = [p[:a.max_prompt_chars] for p in prompts]
    reqs = build_requests(a.requests, a.seed, prompts, a.max_new_tokens)
    spec_args, spec_env = config_args("jetflow-auto", head, "jetflow")  # JETFLOW_BUDGET=auto, explicitly
    spec_env = {**spec_env, "JETFLOW_OVERLAP": a.overlap}
    common = ["--dtype", "float32", "--max-total-tokens", str(a.max_total_tokens), "--max-running-requests",
              str(a.concurrency), "--sleep-on-idle"]
    plain_args = [*common, "--disable-overlap-schedule"]
    env = {"OMP_NUM_THREADS": str(a.threads)}
    logs = Path(tempfile.mkdtemp(prefix="jetflow-soak-"))
    print(f"server logs: {logs}", flush=True)
    configs = {"jetflow": ([*common, *spec_args], {**env, **spec_env}), "plain": (plain_args, env)}
    servers, result, todo = {}, {"errors": [], "phases": {}, "samples": [], "warm_up_s": {}, "start_s": {}}, reqs
    saved_plain = None
    if a.plain_from:
        saved_plain = _saved_plain_phase(a, target, plain_args)
        configs.pop("plain")
    failed = {}  # name -> why it did not start

    def start(name: str) -> Server | None:
        """Start, wait for and warm up one server (None, and the reason in `failed`, if it does not come up)."""
        t_start = time.monotonic()
        args, srv_env = configs[name]
        srv = servers[name] = Server(target, args, logs / f"{name}.log", env=srv_env)
        _LIVE.append(srv)
        try:
            srv.wait_ready()
            result["start_s"][name] = round(time.monotonic() - t_start, 1)
            result["warm_up_s"][name] = warm_up(srv)
        except (RuntimeError, TimeoutError, requests.RequestException) as e:
            failed[name] = f"did not start: {type(e).__name__}: {str(e)[-800:]}"
            return None
        print(f"{name}: started in {result['start_s'][name]} s, warm-up {result['warm_up_s'][name]} s", flush=True)
        return srv

    def stop(name: str) -> None:
        srv = servers.get(name)
        if srv is None or srv not in _LIVE:
            return
        died = srv.proc.poll() is not None
        srv.stop()  # the whole process group, always
        _LIVE.remove(srv)
        if died:
            result.setdefault("kernel_log", {})[name] = _oom_lines()

    sampler = Sampler(t0, a.sample_s)
    sampler.start()
    try:
        ready = {}
        if a.together:  # both start (and compile their warm-ups) at once
            with cf.ThreadPoolExecutor(len(configs)) as pool:
                ready = dict(zip(configs, pool.map(start, configs)))
        for k, name in enumerate(configs):
            t_setup = time.monotonic()
            srv = ready[name] if a.together else (start(name) if time.monotonic() < deadline else None)
            if srv is None:
                why = failed.get(name, "no time left to start it")
                result["errors"].append({"server": name, "i": None, "kind": "server", "error": why})
                stop(name)
                continue
            now = time.monotonic()
            left = len(configs) - k
            setup = 0.0 if a.together else now - t_setup  # the next server needs as long again before its soak
            phase_deadline = now + max(0.0, deadline - now - (left - 1) * setup) / left
            sampler.current = (name, srv)
            try:
                ph = run_phase(name, srv, todo, a.concurrency, phase_deadline, t0)
            except (RuntimeError, TimeoutError, requests.RequestException) as e:  # the warm-up's flush, say
                result["errors"].append({"server": name, "i": None, "kind": "server",
                                         "error": f"{type(e).__name__}: {str(e)[-800:]}"})
                continue
            finally:
                sampler.current = None
                stop(name)
            result["phases"][name] = ph
            result["errors"] += ph["errors"]
            if ph["sent"] < len(todo):
                result["truncated"] = f"{name}: {ph['sent']} of {len(todo)} requests sent"
                todo = [r for r in todo if r["i"] in ph["records"]]  # the next server gets the same ones
    finally:
        sampler.stop()
        result["samples"] = sampler.samples
        for srv in list(_LIVE):
            srv.stop()
        _LIVE.clear()
    result["server_log_errors"] = {name: _log_errors(srv.log) for name, srv in servers.items()}
    if saved_plain is not None:
        result["phases"]["plain"] = saved_plain
    ph = result["phases"]
    n_cmp, bad = compare_greedy(reqs, ph.get("jetflow", {}).get("records", {}), ph.get("plain", {}).get("records", {}))
    result["greedy_compared"], result["greedy_mismatches"] = n_cmp, bad
    mix = {}
    for r in reqs:
        row = mix.setdefault(r["kind"], {"route": r["route"], "count": 0, "greedy": r["greedy"]})
        row["count"] += 1
        if r["route"] not in row["route"].split(" "):
            row["route"] += " " + r["route"]
    result["mix"] = dict(sorted(mix.items()))
    result["passed"] = bool(len(ph) == 2 and not result["errors"] and not bad and n_cmp > 0
                            and ph["jetflow"]["pool_back_to_baseline"])
    for p in ph.values():  # records keyed by str for JSON
        p["records"] = {str(k): v for k, v in sorted(p["records"].items())}
    result["meta"] = {
        "command": " ".join(["python", "scripts/soak_server.py", *(argv if argv is not None else sys.argv[1:])]),
        "target": str(target), "head": str(head), "requests": a.requests, "concurrency": a.concurrency,
        "max_new_tokens": a.max_new_tokens, "max_prompt_chars": a.max_prompt_chars, "seed": a.seed,
        "max_minutes": a.max_minutes, "threads": a.threads, "together": a.together,
        "jetflow_args": [*common, *spec_args], "jetflow_env": spec_env, "plain_args": plain_args, "logs": str(logs),
        "max_total_tokens": a.max_total_tokens, "plain_from": a.plain_from,
        "machine": f"{cpu_model()} ({bf16_isa()}), {platform.machine()}, {os.cpu_count()} cores",
        "sglang": _version("sglang"), "torch": _version("torch"), "date": time.strftime("%Y-%m-%d %H:%M"),
        "wall_s": round(time.monotonic() - t0, 1)}
    result = {"meta": result.pop("meta"), **result}
    print(write_report(Path(a.out), result))
    print(f"server logs: {logs}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
