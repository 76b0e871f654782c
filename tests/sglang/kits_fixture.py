"""A CPU counterpart of SGLang's `SpecEagleServerBase` (sglang/test/server_fixtures/spec_eagle_fixture.py) for
SGLang's speculative-decoding kits (sglang/test/kits/spec_server_kits.py): the same interface (`base_url`,
`process`, `model`, `target_model`, `tokenizer`, `send_request`, `send_requests_abort`, `run_decode`), launched with
this repo's CPU conventions through sgl_server.Server (`--device cpu`, bounded KV pool, JETFLOW_SGLANG_CPU=1,
OMP_NUM_THREADS=1, HF_HUB_OFFLINE=1, the whole process group killed at the end). Import it after
jetflow_sglang.sglang.cpu.ops.install() (SGLang's test utilities reach torchvision).

Differences from the EAGLE fixture, all about running on 2 CPU cores:
- no CustomTestCase: its per-method watcher calls os._exit() on the whole pytest process when the server dies; here
  tearDown fails the test that was running with the server's log instead, and the next tests fail fast on it;
- every HTTP call the kits make gets a timeout (REQUEST_TIMEOUT) if it has none, so a hung server fails a test
  instead of hanging CI;
- `send_request` asks for `abort_max_new_tokens` tokens (the EAGLE fixture: 1024), the only knob of the abort test.
"""
from __future__ import annotations

import random
import time
import unittest
from pathlib import Path

import requests
from sglang.test.server_fixtures.spec_eagle_fixture import PROMPTS  # the prompts of the fixture's helpers

from tests.sglang.sgl_server import Server, process_tree_cpu_s

REQUEST_TIMEOUT = 600.0  # seconds; the longest kit request (the radix kit's 400-prompt batch) takes ~2.5 min here

_orig_session_request = requests.Session.request


def _session_request_with_timeout(self, method, url, *args, **kwargs):
    if not args and kwargs.get("timeout") is None:  # requests.post & co. pass everything by keyword
        kwargs["timeout"] = REQUEST_TIMEOUT
    return _orig_session_request(self, method, url, *args, **kwargs)


class KitServer(Server):
    """sgl_server.Server that can also drop variables inherited from the test process (`unset`), so that a server
    meant to run with a default (JETFLOW_BUDGET unset) does not pick up the caller's."""

    def __init__(self, *args, unset: tuple[str, ...] = (), **kwargs):
        self._unset = tuple(unset)
        super().__init__(*args, **kwargs)

    def _start(self) -> None:
        for key in self._unset:
            self._env.pop(key, None)
        super()._start()


class CpuServerBase(unittest.TestCase):
    """One server per class, from class attributes. Subclasses set `model`, `launch_args()` and `server_env()`
    (the models are resolved by `resolve_models()` at setUpClass, so a class can be collected without them)."""

    model: str = ""
    log_dir: Path | None = None  # server logs (a temporary folder the test module sets)
    name = "server"
    abort_max_new_tokens = 1024
    _tokenizer = None

    # -- launch knobs ----------------------------------------------------------------------------------------
    @classmethod
    def resolve_models(cls) -> None:
        """Set cls.model (and whatever the launch args need) before the launch."""

    @classmethod
    def launch_args(cls) -> list[str]:
        return []

    @classmethod
    def server_env(cls) -> dict:
        return {}

    @classmethod
    def server_unset(cls) -> tuple[str, ...]:
        return ()

    # -- lifecycle -------------------------------------------------------------------------------------------
    @classmethod
    def start_server(cls) -> KitServer:
        """Resolve the models and start this class's server (without waiting for it)."""
        cls.resolve_models()
        log = Path(cls.log_dir or ".") / f"{cls.__name__}.log"
        return KitServer(cls.model, cls.launch_args(), log, env=cls.server_env(), unset=cls.server_unset())

    @classmethod
    def acquire_server(cls) -> KitServer:
        """This class's started and ready server (a subclass may take one started ahead)."""
        return cls.start_server().wait_ready()

    @classmethod
    def release_server(cls, server: KitServer) -> None:
        server.stop()

    @classmethod
    def setUpClass(cls):
        requests.Session.request = _session_request_with_timeout
        cls.server = None
        try:
            cls.server = cls.acquire_server()
        except BaseException:
            cls.tearDownClass()
            raise
        cls.target_model = cls.model
        cls.base_url = cls.server.url
        cls.process = cls.server.proc
        print(f"[kits] {cls.__name__}: {cls.name} server at {cls.base_url}, log {cls.server.log}", flush=True)

    @classmethod
    def tearDownClass(cls):
        try:
            if getattr(cls, "server", None) is not None:
                cls.release_server(cls.server)
                cls.server = None
        finally:
            requests.Session.request = _orig_session_request

    def accounted_pids(self) -> list[int]:
        """Servers whose CPU time counts towards a test's (this class's server; a shared reference adds its own)."""
        return [self.process.pid]

    def _cpu_seconds(self) -> float:
        """CPU time used so far by the accounted servers' processes and by this test process (what a test costs on
        a shared machine, where wall time says little)."""
        return process_tree_cpu_s(*self.accounted_pids(), include_self=True)

    def setUp(self):
        self._t0, self._cpu0 = time.monotonic(), self._cpu_seconds()

    def tearDown(self):
        print(f"[kits] {type(self).__name__}.{self._testMethodName}: {time.monotonic() - self._t0:.1f} s wall, "
              f"{self._cpu_seconds() - self._cpu0:.1f} CPU s", flush=True)
        if self.process.poll() is not None:
            self.fail(f"the {self.name} server exited ({self.process.returncode}) during {self._testMethodName}:\n"
                      f"{self.server.tail(80)}")

    @property
    def tokenizer(self):
        if type(self)._tokenizer is None:
            from sglang.srt.utils.hf_transformers_utils import get_tokenizer

            type(self)._tokenizer = get_tokenizer(self.model)
        return type(self)._tokenizer

    # -- the helpers the kits call (spec_eagle_fixture.SpecEagleServerBase's, same requests) -------------------
    def send_request(self):
        time.sleep(random.uniform(0, 2))
        for prompt in PROMPTS:
            response = requests.post(self.base_url + "/generate", json={
                "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": self.abort_max_new_tokens}})
            assert response.status_code == 200, response.text

    def send_requests_abort(self):
        for prompt in PROMPTS:
            try:
                time.sleep(random.uniform(0, 2))
                requests.post(self.base_url + "/generate", json={
                    "model": "base", "text": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": self.abort_max_new_tokens}},
                    timeout=1)  # the client disconnects: the server must abort the request and keep serving
            except Exception as e:
                print(e)

    def run_decode(self, sampling_params):
        response = requests.post(self.base_url + "/generate", json={
            "text": "Human: Write a travel blog post to Hawaii.\n\nAssistant:",
            "sampling_params": {"max_new_tokens": 48, "n": 1, "temperature": 0.7, **sampling_params},
            "return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": True, "logprob_start_len": 0})
        self.assertEqual(response.status_code, 200, response.text)
