"""SGLang's own speculative-decoding conformance kits (sglang/test/kits/spec_server_kits.py) against float32 JETFLOW
servers on the CPU, once on each target: the default target at a fixed budget (JETFLOW_BUDGET=8) on SGLang's
overlap scheduler, the tiny one at the server's default budget (neither JETFLOW_BUDGET nor
--speculative-num-draft-tokens), synchronous.

The kits are SGLang's unittest mixins, unchanged. kits_fixture.CpuServerBase stands in for SGLang's GPU EAGLE fixture
(the same attributes and helpers, this repo's CPU launch). SpecParityKit's non-speculative reference is a plain float32
CPU server on the same target (the kit's own reference launch passes GPU flags), started once beside the first JETFLOW
server and shared by the control runs below. Servers start one class ahead (_Pool).

Targets:
- the default target, SmolLM2-135M-Instruct with the shipped head, for every kit whose checks need a model that writes
  sensible text: parity, acceptance length, batches, EOS, first-token finish, grammar, logprob start/prefill match,
  ragged token-id logprobs, hidden states, constrained decoding and sampling mask (both with controls, below);
- a tiny random Llama with SmolLM2's tokenizer (kits_models.py: 4 layers of width 64, vocabulary 49152, 8192
  positions) and a tiny untrained head, for five kits that would take most of CI's budget on the real target:
  radix attention (400 requests, ~50k generated tokens), mixed logprobs (112 requests, prompts of up to 2000 tokens),
  request abort (20 requests of up to `abort_max_new_tokens` = 256 tokens, the EAGLE fixture's 1024 on the real
  target being ~10x the cost; 20 more cut off by their client after 1 s), logprob match (512 tokens at T=1) and mixed
  penalties (14 requests at T=0.7). What they check (HTTP 200, token and logprob counts, decode logprobs equal to a
  prefill's, the server survives) does not depend on the text. What the random model weakens: its head is untrained
  and its next-token distribution nearly flat, so greedy trees are accepted less deeply than on the real target
  (accept length about 2-4 against 5.3 on the FastAPI prompt) and sampled ones (logprob match, penalties) almost
  never beyond the root: those two kits exercise the sampled verify path with one-token acceptance only
  (SpecLogprobKit.test_logprob_decode_match_prefill checks decode against prefill logprobs on the real target, greedy).

Not run: SpecAccuracyKit and SpecPerfKit download GSM8K (no network in CI) and run 200 questions at 128 threads
(hours on 2 cores).

Where a kit cannot pass, its test is skipped with the reason, and a separate test runs the control that shows the
cause, on every run:
- SpecFeatureKit.test_constrained_decoding ("Give me a json", json_object, no token limit): SmolLM2 repeats the same
  object inside a JSON array until the token limit. test_constrained_decoding_control sends the same request with
  max_tokens=CONSTRAINED_CAP to the JETFLOW and the plain server and asserts the same text on both, cut by the cap
  with its JSON open, its last objects identical;
- SpecSamplingMaskKit.test_sampling_mask: SGLang's scheduler answers return_sampling_mask with HTTP 400
  "return_sampling_mask is not supported with speculative decoding." for every speculative algorithm outside the
  DFlash family (EAGLE, EAGLE3, NGRAM, STANDALONE, plugins). test_sampling_mask_refused_like_sglangs_own asserts
  that 400, SGLang's own validator giving the same answer for its algorithms, and the kit passing on the plain server.

SpecHiddenStatesKit passes (it checks the rows' count and width). test_hidden_states_rows_follow_accepted_path checks
their values against HF: each row must be the one of the node that emitted the token. It found that the worker
returned rows in tree order (29 of 126 wrong at budget 8); the worker now moves the accepted path's rows to the front
of each request's window, as SGLang's EAGLE does with _compact_accept_to_front.
"""
from __future__ import annotations

import json
import os
import re
import unittest
from pathlib import Path

import pytest
import requests
import torch


torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)
import sglang  # noqa: E402,F401
from jetflow_sglang.sglang.cpu import ops as cpu_ops  # noqa: E402

cpu_ops.install()  # sglang.test.test_utils reaches torchvision (a stub here), as every CPU SGLang process does
from sglang.test.kits.spec_server_kits import (  # noqa: E402
    SpecCorrectnessKit, SpecFeatureKit, SpecGrammarKit, SpecHiddenStatesKit, SpecLogprobKit, SpecParityKit,
    SpecPenaltyKit, SpecSamplingMaskKit, _greedy)

from tests.sglang.kits_fixture import CpuServerBase, KitServer  # noqa: E402
from tests.sglang.sgl_server import plain_default  # noqa: E402

pytestmark = pytest.mark.slow
CpuServerBase.__test__ = False
# A KV pool for the kits' longest requests (radix attention: prompts of up to ~4.5k tokens); sgl_server.Server adds
# --sleep-on-idle, so that the idle plain reference costs nothing while the JETFLOW servers run.
KV_FLAGS = ["--max-total-tokens", "16384", "--max-running-requests", "4"]
PREFETCH_MIN_AVAILABLE = 8 << 30  # bytes; below that, each class starts its server when it begins
CONSTRAINED_CAP = 256  # max_tokens of the constrained-decoding control (the kit's request has none)
SAMPLING_MASK_REFUSAL = "return_sampling_mask is not supported with speculative decoding."
HIDDEN_PROMPTS = ["Repeat: the quick brown fox the quick brown fox the quick brown fox",  # SpecHiddenStatesKit's
                  "Count down from ten: ten nine eight"]
HIDDEN_TOKENS = 64


def _default_models() -> tuple[str, str]:
    from jetflow_sglang.paths import default_paths

    return default_paths()


class _Pool:
    """The module's servers. Each class takes its own (started, if it was not yet), and then starts the next
    selected class's, so that one server's startup (about a minute on 2 cores, nearly all of it imports) runs on the
    core the current class's tests leave idle. At most the plain reference, the current and the next server run;
    the reference stops after its last user."""

    def __init__(self):
        self.plan: list[type] = []  # the selected test classes, in run order (the module fixture below)
        self.servers: dict = {}
        self.plain = None
        self.session = None  # the session's server pool (pool.py), which keeps the shared plain reference

    def start(self, cls) -> KitServer:
        if cls.uses_plain:
            self.start_plain()
        if cls not in self.servers:
            self.servers[cls] = cls.start_server()
        return self.servers[cls]

    def start_plain(self):
        """The plain (no speculation) float32 reference on the default target: the session's shared one
        (sgl_server.PLAIN_DEFAULT: hidden states on, a KV pool of 16384 tokens), held while the module uses it."""
        if self.plain is None:
            self.plain = plain_default(self.session)
            self.plain.hold()
        return self.plain

    def _let_go_of_plain(self) -> None:
        if self.plain is not None:
            self.plain.users -= 1  # it stays up for the session's other modules
            self.plain = None

    def prefetch_after(self, cls) -> None:
        """Start the next selected class's server, where memory allows (a SmolLM2 server takes ~3.5 GB)."""
        import psutil

        if cls in self.plan and self.plan.index(cls) + 1 < len(self.plan) and \
                psutil.virtual_memory().available >= PREFETCH_MIN_AVAILABLE:
            self.start(self.plan[self.plan.index(cls) + 1])

    def release(self, cls) -> None:
        server = self.servers.pop(cls, None)
        if server is not None:
            server.stop()
        later = self.plan[self.plan.index(cls) + 1:] if cls in self.plan else []
        if self.plain is not None and not any(c.uses_plain for c in later):  # the reference's last user
            self._let_go_of_plain()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers = {}
        self._let_go_of_plain()


POOL = _Pool()
_plain_cache: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _server_pool(request, tmp_path_factory, server_pool):
    """Plans the pool's order from the selected tests (module scope: set up before any class's setUpClass) and
    stops every server at the end. Server logs and the tiny models go to one pytest temporary folder."""
    _JetflowServer.log_dir = tmp_path_factory.mktemp("spec_kits")
    POOL.session = server_pool
    for item in request.session.items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, _JetflowServer) and cls not in POOL.plan:
            POOL.plan.append(cls)
    try:
        yield POOL
    finally:
        POOL.stop_all()


def plain_once(key, fn):
    """fn(the ready plain server) once per module: both budgets compare against the same reference output."""
    if key not in _plain_cache:
        _plain_cache[key] = fn(POOL.start_plain().wait_ready())
    return _plain_cache[key]


class _JetflowServer(CpuServerBase):
    __test__ = False
    budget_env: str | None = None  # None: the server's default budget
    overlap = False  # True: SGLang's overlap scheduler (JETFLOW_OVERLAP=on; a CPU server is synchronous by default)
    name = "JETFLOW"
    extra_args: tuple[str, ...] = ()
    uses_plain = False  # whether the class compares against the plain reference
    # SGLang's 0.5 is bf16 rounding noise between the decode and the prefill kernels; in float32 the gap measured
    # 3e-5 (SpecLogprobKit.test_logprob_decode_match_prefill, both budgets), so a real mismatch cannot hide under it.
    logprob_match_delta = 1e-3

    @classmethod
    def acquire_server(cls):
        return POOL.start(cls).wait_ready()

    @classmethod
    def release_server(cls, server):
        POOL.release(cls)

    @classmethod
    def launch_args(cls):
        return ["--dtype", "float32", "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path",
                cls.head, *KV_FLAGS, *cls.extra_args]

    @classmethod
    def server_env(cls):
        env = {} if cls.budget_env is None else {"JETFLOW_BUDGET": cls.budget_env}
        return {**env, "JETFLOW_OVERLAP": "on"} if cls.overlap else env

    @classmethod
    def server_unset(cls):
        return ("JETFLOW_BUDGET",) if cls.budget_env is None else ()


def _skip(reason: str):
    return unittest.skip(reason)(lambda self: None)


class _JetflowKits(SpecParityKit, SpecCorrectnessKit, SpecLogprobKit, SpecPenaltyKit, SpecFeatureKit,
                   SpecGrammarKit, SpecSamplingMaskKit, SpecHiddenStatesKit, _JetflowServer):
    """The kits on the default target; the load kits run on the tiny target (_TinyKits)."""
    __test__ = False
    uses_plain = True
    extra_args = ("--enable-return-hidden-states",)  # SpecHiddenStatesKit; gated per request, others do not pay

    test_radix_attention = test_request_abort = test_logprob_mixed = None  # in _TinyKits
    test_logprob_match = test_penalty_mixed = None  # in _TinyKits

    test_constrained_decoding = _skip("SmolLM2 loops inside valid JSON to the token limit on the plain server too: "
                                      "see test_constrained_decoding_control")
    test_sampling_mask = _skip("SGLang refuses return_sampling_mask for every speculative algorithm outside the "
                               "DFlash family: see test_sampling_mask_refused_like_sglangs_own")

    @classmethod
    def resolve_models(cls):
        cls.model, cls.head = _default_models()

    @classmethod
    def setUpClass(cls):
        """SpecParityKit.setUpClass launches its reference with GPU flags on SGLang's test port; here the reference is
        the module's plain CPU server, which starts beside the first JETFLOW server."""
        super(SpecParityKit, cls).setUpClass()  # the fixture's launch (the MRO after the kit's own setUpClass)
        cls.parity_ref_outputs = plain_once(
            "parity", lambda ref: {p: _greedy(ref.url, p) for p in cls.parity_prompts})
        POOL.prefetch_after(cls)

    def accounted_pids(self):
        return [self.process.pid] + ([POOL.plain.proc.pid] if POOL.plain is not None else [])

    # -- controls for the kits skipped above ---------------------------------------------------------------------
    def _constrained(self, url: str) -> dict:
        """SpecFeatureKit.test_constrained_decoding's request, with a token cap."""
        r = requests.post(url + "/v1/chat/completions", json={
            "model": self.model,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "Give me a json"}],
            "temperature": 0, "response_format": {"type": "json_object"}, "max_tokens": CONSTRAINED_CAP})
        self.assertEqual(r.status_code, 200, r.text)
        choice = r.json()["choices"][0]
        return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"]}

    def test_constrained_decoding_control(self):
        """The plain server fails SpecFeatureKit.test_constrained_decoding too: it repeats the same JSON object in an
        array and reaches the token cap with its JSON open; JETFLOW writes the same text."""
        ours = self._constrained(self.base_url)
        ref = plain_once("constrained", lambda srv: self._constrained(srv.url))
        self.assertEqual(ours, ref)  # JETFLOW writes what the plain server writes, token for token
        self.assertEqual(ref["finish_reason"], "length", ref)
        with self.assertRaises(json.JSONDecodeError):
            json.loads(ref["content"])
        objects = re.findall(r"\{[^{}]*\}", ref["content"])  # the innermost complete objects
        self.assertGreaterEqual(len(objects), 4, ref)
        self.assertEqual(len(set(objects[-3:])), 1, f"the plain server's last objects do not repeat: {ref}")

    def test_sampling_mask_refused_like_sglangs_own(self):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_sampling_mask import validate_spec_sampling_mask_request

        body = {"text": ["The capital of France is"] * 2, "return_sampling_mask": True,
                "sampling_params": [{"temperature": 0.0, "top_k": 1, "max_new_tokens": 7, "ignore_eos": True},
                                    {"temperature": 1.0, "top_k": 10, "top_p": 0.95, "max_new_tokens": 7,
                                     "ignore_eos": True}]}
        r = requests.post(self.base_url + "/generate", json=body)
        self.assertEqual(r.status_code, 400, r.text)
        self.assertEqual(r.json()["error"]["message"], SAMPLING_MASK_REFUSAL)
        self.assertIsNone(self.process.poll())
        # SGLang's own validator (the scheduler's) answers the same for its non-DFlash algorithms
        for algo in (SpeculativeAlgorithm.EAGLE, SpeculativeAlgorithm.EAGLE3, SpeculativeAlgorithm.NGRAM,
                     SpeculativeAlgorithm.STANDALONE):
            self.assertEqual(validate_spec_sampling_mask_request(None, algo), SAMPLING_MASK_REFUSAL)
        # and the kit itself passes on the plain server
        self.base_url = POOL.start_plain().wait_ready().url
        try:
            SpecSamplingMaskKit.test_sampling_mask(self)
        finally:
            del self.base_url  # back to the class's (the JETFLOW server)

    # -- hidden states: SpecHiddenStatesKit checks the rows' count and width; these check their values -------------
    def _hidden(self, url: str) -> list[dict]:
        r = requests.post(url + "/generate", json={
            "text": HIDDEN_PROMPTS, "return_hidden_states": True, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0, "max_new_tokens": HIDDEN_TOKENS, "ignore_eos": True}})
        self.assertEqual(r.status_code, 200, r.text)
        return [{"input_ids": [t[1] for t in o["meta_info"]["input_token_logprobs"]], "output_ids": o["output_ids"],
                 "hidden": o["meta_info"]["hidden_states"]} for o in r.json()]

    def _wrong_rows(self, outs: list[dict], layers) -> list[str]:
        """Rows that are not HF's hidden states at the emitted token's input position (row i of a request: the
        forward of output token i-1; `layers` picks HF hidden_states entries, concatenated)."""
        hf = _hf_model(self.model)
        wrong = []
        for r, o in enumerate(outs):
            with torch.no_grad():
                hs = hf(torch.tensor([o["input_ids"] + o["output_ids"]]), output_hidden_states=True).hidden_states
            want = torch.cat([hs[i][0] for i in layers], -1)
            p = len(o["input_ids"])
            for i, row in enumerate(o["hidden"][1:], start=1):
                got, ref = torch.tensor(row), want[p + i - 1]
                err = float((got - ref).abs().max()) if got.shape == ref.shape else float("inf")
                if err > 1e-3 * max(1.0, float(ref.abs().max())):
                    wrong.append(f"request {r} row {i}/{len(o['hidden']) - 1}: max |got - HF| = {err:.3g}")
        return wrong

    def _jetflow_hidden(self) -> list[dict]:
        cls = type(self)
        if "_hidden_out" not in cls.__dict__:
            cls._hidden_out = self._hidden(self.base_url)
        return cls._hidden_out

    def test_hidden_states_controls(self):
        """The plain server's rows are HF's final (normed) hidden states at each emitted token, which validates the
        comparison; JETFLOW emits the plain server's tokens, one row per token, each the width of the head's tap
        layers concatenated (SGLang returns its captured aux hidden states when an algorithm captures them, as for
        EAGLE3 and DFLASH)."""
        ref = plain_once("hidden", lambda srv: self._hidden(srv.url))
        self.assertEqual(self._wrong_rows(ref, [-1]), [])
        outs = self._jetflow_hidden()
        self.assertEqual([o["output_ids"] for o in outs], [o["output_ids"] for o in ref])
        width = len(self._taps()) * _hf_model(self.model).config.hidden_size
        for o in outs:
            self.assertEqual(len(o["hidden"]), len(o["output_ids"]))
            self.assertEqual({len(row) for row in o["hidden"][1:]}, {width})

    def _check_hidden_rows(self):
        """Row i of a request must be HF's tap-layer outputs at the input of emitted token i (the concrete classes'
        test_hidden_states_rows_follow_accepted_path)."""
        wrong = self._wrong_rows(self._jetflow_hidden(), [layer + 1 for layer in self._taps()])
        self.assertEqual(wrong, [], f"{len(wrong)} rows are not the emitted tokens':\n" + "\n".join(wrong))

    def _taps(self) -> list[int]:
        return json.loads((Path(self.head) / "config.json").read_text())["tap_layers"]


_hf = {}


def _hf_model(path: str):
    if path not in _hf:
        from transformers import AutoModelForCausalLM

        _hf[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf[path]


class _TinyKits(_JetflowServer):
    """The load kits (and the two sampled ones), on the tiny wide-vocabulary target."""
    __test__ = False
    name = "JETFLOW (tiny target)"
    # the radix kit sends 400 requests at once (the EAGLE fixture's cap: 64); tiny KV rows (1 KB per token)
    extra_args = ("--max-total-tokens", "65536", "--max-running-requests", "64")
    abort_max_new_tokens = 256
    test_radix_attention = SpecFeatureKit.test_radix_attention
    test_request_abort = SpecFeatureKit.test_request_abort
    test_logprob_mixed = SpecLogprobKit.test_logprob_mixed
    test_logprob_match = SpecLogprobKit.test_logprob_match
    test_penalty_mixed = SpecPenaltyKit.test_penalty_mixed

    @classmethod
    def resolve_models(cls):
        from tests.sglang.kits_models import build_tiny_llama_wide
        from tests.sglang.sgl_fixtures import build_tiny_head

        target, _ = _default_models()
        cls.model = str(build_tiny_llama_wide(cls.log_dir / "tiny-llama", target))
        cls.head = str(build_tiny_head(cls.model, cls.log_dir / "tiny-head"))

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        POOL.prefetch_after(cls)


# Two servers cover both budgets (the default `auto`, and JETFLOW_BUDGET=8) and both schedulers (synchronous, and
# SGLang's overlap scheduler, the default off the CPU): the default target on the overlap scheduler at budget 8 (fixed
# trees every round: the strict acceptance and hidden-row checks), the tiny one synchronous at the default budget.
# Until 2026-12-07 each target also ran the other combination (four servers, 17 of CI's minutes); every kit still
# runs, once.
# The tiny class's server starts while the default target's tests run (_Pool.prefetch_after).
class _KitsBudget8(_JetflowKits):
    budget_env = "8"
    # Measured (SmolLM2, shipped head, budget 8, float32 greedy: the same on every run): 5.28 on the FastAPI prompt,
    # 1.77 on the four short prompts at batch 4.
    acc_length_thres = 4.0
    batch_accept_len_thres = 1.4

    def test_hidden_states_rows_follow_accepted_path(self):
        self._check_hidden_rows()


class TestKitsOverlapBudget8(_KitsBudget8):
    __test__ = True
    overlap = True


class TestTinyKitsDefaultBudget(_TinyKits):
    __test__ = True
