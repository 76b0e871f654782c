"""SGLang's own frontend test programs (`sglang/test/test_programs.py`) against a float32 JETFLOW server and a float32
plain server on the default target (SmolLM2-135M-Instruct, the shipped head), started side by side.

SGLang's test functions run unchanged through one `RuntimeEndpoint` that sends each call to the server of the run it
belongs to and records it (prompt, sampling parameters, text, meta_info); the two servers' runs go in parallel. The
programs' answer-quality asserts are not the check (a 135M model may fail them on any server). Instead:
- greedy programs (select, regex, decode_json_regex, tool_use; mt_bench and stream once more forced to temperature 0):
  every call's prompt and output on JETFLOW are the plain server's, text for text, with the same number of tokens and
  the same finish reason; select picks the same choice with the same scores;
- constrained outputs hold when sampled on JETFLOW: regex and decode_json_regex forced to temperature HOT_T (at most
  HOT_MAX_TOKENS tokens a call). Every value matches its regex (a value cut off by the limit: a prefix of a match),
  and each complete JSON value parses as its type: the name with json.loads, the numbers with int()/float(). SGLang's
  REGEX_INT and REGEX_FLOAT admit "+6" and ".5", which are no JSON numbers, so the program's own json.loads of the
  whole object is no criterion when sampling. select scores its choices by prefill logprobs and has no temperature
  (SGLang's endpoint asserts 0): its greedy run covers it;
- sampled programs as written (mt_bench at 0.7, stream at 1.0, parallel_decoding at 0.3 with 5 forks), each call cut
  to SAMPLED_MAX_TOKENS, complete on both servers without error, with text, within their stop strings and token
  limits.

Left out, because they fail on the plain server too (SGLang 0.5.23, the same float32 plain server on this target):
- test_parallel_encoding hangs: `POST /concate_and_append_request` answers 404 {"detail": "Not Found"}, the
  executor thread stops on that error and the program waits for its answer (still waiting after 120 s);
- test_stream_logprobs fails its own assert (`len(chunk_output_token_logprobs) == completion_tokens -
  prev_completion_tokens`): the streamed logprobs are cumulative."""
from __future__ import annotations

import concurrent.futures as cf
import contextvars
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import torch

from tests.sglang.sgl_server import plain_default  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":  # the lite install: bash scripts/install_sglang_cpu.sh .venv
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
BUDGET = 8
HOT_T, HOT_MAX_TOKENS = 0.8, 32  # JSON numbers run to their token limit when sampled (REGEX_INT is [0-9]+)
# The sampled programs at their own temperatures and structure, at most this many tokens a call: as written they drew
# 1.6k tokens a server (parallel_decoding's forks 850, stream 256), 60% of the module's CI time, for a check (they
# complete, within their stops and limits) that the first tokens of each call already make
SAMPLED_MAX_TOKENS = 48
GREEDY = ["select", "regex", "decode_json_regex", "tool_use"]  # temperature 0 as written
SAMPLED = ["mt_bench", "stream", "parallel_decoding"]  # temperature 0.7, 1.0 (the frontend's default) and 0.3
IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"  # test_regex's
RUN_TIMEOUT = 1800  # s for all of one server's runs: only a guard against a hung call


@dataclass
class _Run:
    """One server's run of some programs, at their own temperatures or all at `temperature` (and with at most
    `max_new_tokens` per call)."""
    url: str
    temperature: float | None = None
    max_new_tokens: int | None = None
    program: str = ""
    calls: list = field(default_factory=list)
    quality: dict = field(default_factory=dict)  # program -> its own answer assert that failed (not a criterion)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, t0: float, **rec) -> None:
        with self.lock:
            self.calls.append({"program": self.program, "seconds": round(time.monotonic() - t0, 2), **rec})

    def of(self, program: str) -> list[dict]:
        calls = [c for c in self.calls if c["program"] == program]
        assert calls, f"{program}: no call reached {self.url}"
        errors = [c for c in calls if "error" in c]
        assert not errors, f"{program}: {errors}"
        return calls


# The run of the current thread. A program's executor threads copy the context of the thread that creates them (the
# run's own thread, also for forks and streams), so each call finds its run.
_RUN: contextvars.ContextVar[_Run] = contextvars.ContextVar("frontend_run")


def _endpoint(url: str):
    """One RuntimeEndpoint for both servers (`url`: the one it reads the model's info from). Each call goes to the
    calling run's server and is recorded there: the executor thread only warns on a failed call, so the record is
    what fails the test."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    class _Routed(RuntimeEndpoint):
        @property
        def base_url(self):
            return _RUN.get().url  # LookupError outside a run

        @base_url.setter
        def base_url(self, value):  # RuntimeEndpoint.__init__ sets it
            pass

        @staticmethod
        def _params(sp):
            run = _RUN.get()
            if run.temperature is not None:
                sp.temperature = run.temperature
            if run.max_new_tokens is not None:
                sp.max_new_tokens = min(sp.max_new_tokens, run.max_new_tokens)
            return sp

        def generate(self, s, sampling_params):
            run, prompt, sp, t0 = _RUN.get(), s.text_, self._params(sampling_params), time.monotonic()
            try:
                text, meta = super().generate(s, sp)
            except Exception as e:
                run.record(t0, kind="gen", prompt=prompt, error=repr(e))
                raise
            run.record(t0, kind="gen", prompt=prompt, text=text, meta=meta, regex=sp.regex, stop=_stops(sp.stop),
                       max_new_tokens=sp.max_new_tokens, temperature=sp.temperature)
            return text, meta

        def generate_stream(self, s, sampling_params):
            run, prompt, sp, t0 = _RUN.get(), s.text_, self._params(sampling_params), time.monotonic()
            text, meta, chunks = "", None, 0
            try:
                for chunk, meta in super().generate_stream(s, sp):
                    text, chunks = text + chunk, chunks + 1
                    yield chunk, meta
            except Exception as e:
                run.record(t0, kind="stream", prompt=prompt, error=repr(e))
                raise
            run.record(t0, kind="stream", prompt=prompt, text=text, meta=meta, chunks=chunks, regex=sp.regex,
                       stop=_stops(sp.stop), max_new_tokens=sp.max_new_tokens, temperature=sp.temperature)

        def select(self, s, choices, temperature, choices_method):
            run, prompt, t0 = _RUN.get(), s.text_, time.monotonic()
            try:
                dec = super().select(s, choices, temperature, choices_method)
            except Exception as e:
                run.record(t0, kind="select", prompt=prompt, error=repr(e))
                raise
            run.record(t0, kind="select", prompt=prompt, choices=list(choices), decision=dec.decision,
                       scores=(dec.meta_info or {}).get("normalized_prompt_logprobs"))
            return dec

    token = _RUN.set(_Run(url))
    try:
        return _Routed(url)  # reads /get_model_info
    finally:
        _RUN.reset(token)


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _run_all(url: str, plan: list[tuple[float | None, int | None, list[str]]]) -> list[_Run]:
    """Run SGLang's test functions on one server (in this thread): for each (temperature, max_new_tokens, programs)
    of the plan."""
    from sglang.test import test_programs as tp

    runs = []
    for temperature, max_new_tokens, programs in plan:
        run = _Run(url, temperature, max_new_tokens)
        _RUN.set(run)
        for name in programs:
            run.program = name
            fn = getattr(tp, f"test_{name}")
            try:
                fn(False) if name == "select" else fn()  # select: check_answer=False
            except (AssertionError, ValueError) as e:  # its own answer check (json.loads: ValueError)
                run.quality[name] = f"{type(e).__name__}: {str(e)[:300]}"
        runs.append(run)
    return runs


def _key(c: dict) -> tuple:
    """What must be identical between JETFLOW and plain for a greedy call (forks may finish in any order)."""
    if c["kind"] == "select":
        return c["kind"], c["prompt"], c["decision"]
    m = c["meta"]
    return c["kind"], c["prompt"], c["text"], m["completion_tokens"], json.dumps(m["finish_reason"], sort_keys=True)


def _check_call(c: dict, where: str) -> None:
    """What every call must respect at any temperature: its choices, token limit, stop strings and regex."""
    if c["kind"] == "select":
        assert c["decision"] in c["choices"], (where, c)
        return
    m, text = c["meta"], c["text"]
    assert m["completion_tokens"] <= c["max_new_tokens"], (where, m)
    matched = m["finish_reason"].get("matched")
    for stop in c["stop"]:
        # SGLang cuts the text at the first occurrence of the stop string it matched; another one of the request's
        # stop strings can only be left in the last step's text (when one token holds both, e.g. "\n " for " "/"\n")
        pos = text.find(stop)
        assert pos < 0 or (isinstance(matched, str) and stop != matched and len(text) - pos <= 16), (where, stop, text)
    # U+FFFD: a byte token that decodes to no character on its own
    # DOTALL: SGLang's grammar backend (xgrammar) lets `.` match a newline too, and test_regex's IP regex has an
    # unescaped `.`, so "11\n12\n1\n135" is a valid sampled answer (Python's `.` alone would refuse it)
    if c["regex"] is not None and "\ufffd" not in text:
        if m["finish_reason"]["type"] != "length":
            assert re.fullmatch(c["regex"], text, re.DOTALL), (where, c["regex"], text, m["finish_reason"])
        else:  # cut off by the token limit: a prefix of a match (`regex`, a dependency of transformers)
            import regex

            assert regex.fullmatch(c["regex"], text, regex.DOTALL, partial=True), (where, c["regex"], text)


# -- servers and runs -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["sync", "overlap"])
def servers(server_pool, request):
    """(JETFLOW server, plain server) on the default target in float32; the JETFLOW worker synchronous (a CPU
    server's default) or on SGLang's overlap scheduler (JETFLOW_OVERLAP=on); plain is the session's shared reference
    (sgl_server.PLAIN_DEFAULT)."""
    from jetflow_sglang.paths import default_paths

    target, head = default_paths()
    if not (Path(head) / "model.safetensors").is_file():
        pytest.skip(f"no shipped head in {head}")
    spec = server_pool.get(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                    "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens",
                                    str(BUDGET)],
                           env={"JETFLOW_OVERLAP": "on" if request.param == "overlap" else "off"},
                           name=f"frontend-{request.param}", shared=False)
    with server_pool.use(spec, plain_default(server_pool)) as up:
        yield up


_PLAIN_RUNS: dict = {}  # the plain server's runs, once per module


@pytest.fixture(scope="module")
def runs(servers):
    """Both servers run every program as written, then mt_bench and stream forced to temperature 0; JETFLOW also runs
    regex and decode_json_regex forced to HOT_T. The two servers' runs go in parallel threads."""
    import sglang as sgl

    spec, plain = servers
    sgl.set_default_backend(_endpoint(spec.url))
    common = [(None, None, GREEDY), (None, SAMPLED_MAX_TOKENS, SAMPLED), (0.0, None, ["mt_bench", "stream"])]
    hot = (HOT_T, HOT_MAX_TOKENS, ["regex", "decode_json_regex"])
    plans = {"jetflow": (spec, common + [hot]), "plain": (plain, common)}
    if _PLAIN_RUNS:  # the shared plain server ran them for the other scheduler mode: its answers do not depend on it
        plans.pop("plain")
    t0 = time.monotonic()
    pool = cf.ThreadPoolExecutor(2)
    futures = {name: pool.submit(_run_all, srv.url, plan) for name, (srv, plan) in plans.items()}
    try:
        out = {name: dict(zip(("as_written", "sampled", "greedy", "hot"), f.result(timeout=RUN_TIMEOUT)))
               for name, f in futures.items()}
    finally:
        pool.shutdown(wait=False)  # a hung call ends when the servers are stopped
    out["plain"] = _PLAIN_RUNS.setdefault("plain", out.get("plain"))
    print(f"\nfrontend programs: {time.monotonic() - t0:.0f} s; every call in {spec.log.parent / 'calls.json'}")
    (spec.log.parent / "calls.json").write_text(json.dumps(
        {f"{name}/{kind}": r.calls for name, rs in out.items() for kind, r in rs.items()}, indent=1, default=str))
    for name, rs in out.items():
        for kind, r in rs.items():
            print(f"{name}/{kind}: {len(r.calls)} calls, "
                  f"{sum(c['meta']['completion_tokens'] for c in r.calls if 'meta' in c)} tokens, "
                  f"{sum(c['seconds'] for c in r.calls):.0f} s; own answer checks failed: {r.quality or 'none'}")
    return out


# -- tests ----------------------------------------------------------------------------------------------------------
def _same(a: list[dict], b: list[dict], program: str) -> None:
    ka, kb = sorted(map(_key, a)), sorted(map(_key, b))
    if len(ka) != len(kb):
        pytest.fail(f"{program}: {len(ka)} calls on JETFLOW, {len(kb)} on the plain server")
    for x, y in zip(ka, kb):
        if x != y:  # (kind, prompt, text, completion_tokens, finish_reason) or (kind, prompt, decision)
            pytest.fail(f"{program}: JETFLOW differs from the plain server after the prompt ending {x[1][-300:]!r}"
                        f"{'' if x[1] == y[1] else f' (plain: {y[1][-300:]!r})'}:\nJETFLOW {x[2:]}\nplain   {y[2:]}")


@pytest.mark.parametrize("program", GREEDY)
def test_greedy_program_identical_to_plain(runs, program):
    a, b = runs["jetflow"]["as_written"].of(program), runs["plain"]["as_written"].of(program)
    for c in a + b:
        _check_call(c, program)
        if c["kind"] != "select":
            assert c["temperature"] == 0, c
    _same(a, b, program)
    for x, y in zip(sorted(a, key=_key), sorted(b, key=_key)):  # select: the choices' scores too
        if x["kind"] == "select":
            assert x["scores"] == pytest.approx(y["scores"], abs=1e-3), (x, y)


@pytest.mark.parametrize("program", ["mt_bench", "stream"])
def test_sampled_program_forced_greedy_identical_to_plain(runs, program):
    a, b = runs["jetflow"]["greedy"].of(program), runs["plain"]["greedy"].of(program)
    for c in a + b:
        assert c["temperature"] == 0, c
        _check_call(c, program)
        assert c["text"], c
    _same(a, b, program)


@pytest.mark.parametrize("program", ["regex", "decode_json_regex"])
def test_constraints_hold_when_sampled(runs, program):
    hot = runs["jetflow"]["hot"]
    calls = hot.of(program)
    for c in calls:
        assert c["temperature"] == HOT_T, c
        _check_call(c, program)
    if program == "regex":  # _check_call matched it
        (c,) = calls
        assert c["regex"] == IP_REGEX and c["meta"]["finish_reason"]["type"] != "length", c
    else:  # each value its JSON type, unless cut off by the token limit
        name, population, area, latitude = calls
        assert [c["regex"] is not None for c in calls] == [True] * 4, calls
        if name["meta"]["finish_reason"]["type"] != "length":
            assert isinstance(json.loads(name["text"], strict=False), str), name
        for c, typ in ((population, int), (area, int), (latitude, float)):
            if c["meta"]["finish_reason"]["type"] != "length":
                typ(c["text"])


def _outcomes(calls: list[dict]) -> list:
    return [(c["text"][:40], c["meta"]["completion_tokens"], c["meta"]["finish_reason"]) for c in calls]


@pytest.mark.parametrize("program", SAMPLED)
def test_sampled_program_completes(runs, program):
    for name in ("jetflow", "plain"):
        calls = runs[name]["sampled"].of(program)
        for c in calls:
            assert c["temperature"] > 0, c
            _check_call(c, f"{name}/{program}")
        if name == "plain" and not any(c["text"].strip() for c in calls):
            # the reference, not the product: a sampled run that says nothing (seen once in CI, mt_bench on plain,
            # 2026-12-07) is run once more before it fails the module; JETFLOW's run gets no second try
            first = _outcomes(calls)
            calls = _run_all(runs[name]["sampled"].url, [(None, SAMPLED_MAX_TOKENS, [program])])[0].of(program)
            assert any(c["text"].strip() for c in calls), (name, program, first, _outcomes(calls))
        assert any(c["text"].strip() for c in calls), (name, program, _outcomes(calls))
        if program == "stream":
            assert all(c["kind"] == "stream" and c["chunks"] > 0 for c in calls), calls


def test_each_call_reached_its_server(runs):
    """Every JETFLOW call of two tokens or more went through verify rounds, no plain one did: each call went to its
    own run's server. JETFLOW accepted more than one token a round somewhere."""
    for name, rs in runs.items():
        for c in (c for r in rs.values() for c in r.calls if "meta" in c):
            verify_ct = c["meta"].get("spec_verify_ct") or 0
            if name == "plain":
                assert verify_ct == 0, c
            elif c["meta"]["completion_tokens"] >= 2:
                assert verify_ct >= 1, c
    assert max(c["meta"].get("spec_accept_length", 0) for r in runs["jetflow"].values() for c in r.calls
               if "meta" in c) > 1.0


def test_servers_still_serving(servers, runs):
    for srv in servers:
        assert srv.proc.poll() is None and requests.get(srv.url + "/health", timeout=30).ok, srv.tail()
        assert "Traceback" not in srv.log.read_text(errors="replace"), srv.tail()
