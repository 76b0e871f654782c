"""Start and stop real SGLang servers on 127.0.0.1 for the tests (always killed, whole process group)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

MEMORY_FLAGS = ["--max-total-tokens", "4096", "--max-running-requests", "4"]
# An idle server without --sleep-on-idle busy-polls a whole core: with a module's two servers up on 2 cores, the idle
# one halved the other's CPU, and 6 such servers made a benchmark level 0.21x (bench/results/RESULTS.md).
IDLE_FLAGS = ["--sleep-on-idle"]
# Memory: every start in a test process goes through `make_room` first. A server takes its memory (imports, weights,
# the KV pool) over its first minute, so `available` does not show the starts still under way: each counts
# STARTING_COST until it is ready or STARTING_S old. Below MIN_AVAILABLE, the session pool (pool.py) stops idle
# servers it may stop (EVICTORS); under pytest-xdist the start then waits up to MEMORY_WAIT_S for the other worker's
# module to let its servers go, and then starts rather than fail. (A start that ran past memory was killed by the
# kernel mid-module: "connection refused" in whichever test asked next.)
MIN_AVAILABLE = 4 << 30
# measured on 2026-12-07 (available memory before and after): a SmolLM2 JETFLOW server 2.5 GB once ready (1.3 GB of
# it after 20 s), a tiny one 1.6 GB
STARTING_COST, STARTING_S = 5 << 29, 120
MEMORY_WAIT_S = 600
EVICTORS: list = []  # callables: stop one idle server and say True, or say False
_STARTED: list = []  # this process's servers, for the starts still under way
# One lock for every start in this process and for the pool (pool.py uses it as its own): starts from several threads
# (scripts/soak_server.py) see each other, and a start that asks the pool to stop a server cannot deadlock with a
# `get` that starts one.
GATE = threading.RLock()
# How test servers start: forked children by default (fork_launch.py: a third of the CPU a start takes), or as users
# launch them, `python -m sglang.launch_server` with spawned children, for the modules that test start-up itself
# (Server(spawn=True)) and for every server with JETFLOW_TEST_LAUNCH=spawn.
SPAWN_ALL = os.environ.get("JETFLOW_TEST_LAUNCH", "fork") == "spawn"
FORK_LAUNCHER = str(Path(__file__).with_name("fork_launch.py"))


def unseen_bytes() -> int:
    now = time.monotonic()
    with GATE:
        return STARTING_COST * sum(1 for s in _STARTED if not s.seen_ready and now - s.started_at < STARTING_S
                                   and s.proc.poll() is None)


def effective_available() -> int:
    import psutil

    return psutil.virtual_memory().available - unseen_bytes()


def make_room() -> None:
    while effective_available() < MIN_AVAILABLE and any(evict() for evict in EVICTORS):
        pass
    deadline = time.monotonic() + (MEMORY_WAIT_S if os.environ.get("PYTEST_XDIST_WORKER") else 0)
    while effective_available() < MIN_AVAILABLE and time.monotonic() < deadline:
        time.sleep(5)
        while effective_available() < MIN_AVAILABLE and any(evict() for evict in EVICTORS):
            pass


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port the kernel hands out (bind to port 0) may be handed out
    again while the server starts: a --tp 2 server's gloo sockets took it once, and uvicorn then failed to bind
    ("address already in use") while the process stayed up."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(20000, max(20001, low - 1100))  # SGLang derives its own ports up to port + 1000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class Server:
    BIND_TRIES = 3  # a port taken between free_port() and the server's bind is retried on another

    def __init__(self, model: str, args: list[str], log: Path, env: dict | None = None, timeout: float = 420,
                 spawn: bool = False):
        self._model, self._args, self.log, self.timeout = model, list(args), log, timeout
        self.spawn = spawn or SPAWN_ALL
        self._env = {**os.environ, "JETFLOW_SGLANG_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                     **(env or {})}
        self._start()

    def _command(self) -> list[str]:
        launcher = ["-m", "sglang.launch_server"] if self.spawn else [FORK_LAUNCHER]
        return [sys.executable, *launcher, "--model-path", self._model, "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(self.port), *MEMORY_FLAGS, *IDLE_FLAGS, *self._args]

    def _start(self) -> None:
        with GATE:
            make_room()
            self.seen_ready, self.started_at = False, time.monotonic()
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._log_f = open(self.log, "w")
            self.proc = subprocess.Popen(self._command(), stdout=self._log_f, stderr=subprocess.STDOUT,
                                         env=self._env, start_new_session=True)
            _STARTED[:] = [s for s in _STARTED if s.proc.poll() is None] + [self]

    def _wait_once(self) -> str:
        """'ready', 'bind' (uvicorn could not bind its port and the process stays up) or 'timeout'."""
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if requests.get(self.url + "/model_info", timeout=2).ok and \
                        requests.get(self.url + "/health", timeout=5).ok:
                    return "ready"
            except requests.RequestException:
                pass
            if "address already in use" in self.tail(20):
                return "bind"
            time.sleep(1.0)
        return "timeout"

    def wait_ready(self) -> "Server":
        for attempt in range(1, self.BIND_TRIES + 1):
            state = self._wait_once()
            if state == "ready":
                self.seen_ready = True
                return self
            log = self.tail()
            self.stop()
            if state == "timeout":
                raise TimeoutError(f"sglang server not ready in {self.timeout} s:\n{log}")
            if attempt == self.BIND_TRIES:
                raise RuntimeError(f"sglang server could not bind a port in {self.BIND_TRIES} tries:\n{log}")
            self._start()  # on another port

    def tail(self, n: int = 60) -> str:
        if not self._log_f.closed:
            self._log_f.flush()
        return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """Kill the whole process group at once. A SIGTERM makes SGLang's launcher wait 5 s for crash diagnostics once
        its scheduler exits (6 s a stop, ~80 stops a run); no test reads a server's shutdown."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self._log_f.close()

    # -- requests --------------------------------------------------------------------------------------------
    def generate(self, timeout: float = 300, **body) -> dict:
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def flush_cache(self, timeout: float = 30) -> bool:
        """POST /flush_cache until it succeeds. SGLang refuses (400) while its running batch still holds a request,
        and a request that has just returned to its client may stay there until the scheduler's next step."""
        deadline = time.monotonic() + timeout
        while True:
            if requests.post(self.url + "/flush_cache", timeout=60).ok:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def post(self, path: str, body: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)

    def jetflow_state(self) -> dict:
        """The JETFLOW worker's record in /server_info (its first scheduler's): steps, budgets, host syncs, ..."""
        return requests.get(self.url + "/server_info", timeout=30).json()["internal_states"][0]["jetflow"]


def running(*servers: Server):
    """A module fixture's body: yields the servers (a tuple) once every one is ready, and always stops them all."""
    try:
        yield tuple(s.wait_ready() for s in servers)
    finally:
        for s in servers:
            s.stop()


def jetflow_server(target, head, log: Path, budget: int, *extra: str, env: dict | None = None,
                   spawn: bool = False) -> Server:
    """A float32 JETFLOW server on a tiny target with a tiny head (starting: call wait_ready)."""
    return Server(str(target), ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens",
                                str(budget), *extra], log, env=env, spawn=spawn)


def process_tree_cpu_s(*pids: int, include_self: bool = False) -> float:
    """CPU seconds (user + system) used so far by each pid and its children (a server: launcher, scheduler,
    detokenizer), plus this process alone (not its children) with include_self. Gone processes count 0."""
    import psutil

    procs = [psutil.Process()] if include_self else []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            pass
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# The launches several modules share through the server pool (pool.py): the plain float32 reference on the tiny
# Qwen3 (sgl_fixtures.shared_tiny), SGLang's NGRAM on it, and the plain float32 reference on the default target.
# The tiny models say 512 positions; RoPE has no limit, and test_sglang_serving sends prompts of up to 4.4k tokens.
LONG_ENV = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
PLAIN_TINY = ["--dtype", "float32", "--max-running-requests", "8", "--context-length", "4400"]
NGRAM_TINY = ["--dtype", "float32", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
              "--attention-backend", "jetflow_tree_native", "--max-running-requests", "4"]
NO_TRITON = {"TRITON_INTERPRET": "0"}


def plain_tiny(pool, target, shared: bool = True):
    """The plain float32 reference on a tiny model (PLAIN_TINY; started if it is not up, not waited for)."""
    srv = pool.get(target, PLAIN_TINY, env=LONG_ENV, name=f"plain-{Path(target).name}", shared=shared)
    srv.memo = True
    return srv  # as a user's CPU server (tests/conftest.py turns the interpreter on)


# The plain float32 reference on the default target that every module comparing against plain SGLang there shares
# (pool.py): the overlap scheduler off (penalty counts lag under it), and the features whose requests the modules
# send (streaming sessions, priorities, hidden states); none of them changes a greedy token. The KV pool holds the
# kits' longest requests (tests/sglang/test_spec_kits.py).
PLAIN_DEFAULT = ["--dtype", "float32", "--disable-overlap-schedule", "--enable-streaming-session",
                 "--enable-priority-scheduling", "--enable-return-hidden-states", "--max-total-tokens", "16384",
                 "--max-running-requests", "8"]


def plain_default(pool):
    """The shared plain reference on the default target (started if it is not up; not waited for)."""
    from jetflow_sglang.paths import default_paths

    srv = pool.get(default_paths()[0], PLAIN_DEFAULT, env=NO_TRITON, name="plain-default")
    srv.memo = True
    return srv


def default_target_servers(pool, args: list[str], spec_env: dict, plain_args: list[str] | None = None,
                           budget: int = 6):
    """A module fixture's body on the default target with the shipped head: (JETFLOW synchronous, JETFLOW on the
    overlap scheduler, plain, target path), float32, a fixed budget, the Triton interpreter off. The JETFLOW servers
    are the module's own (stopped after it); plain is the shared reference (PLAIN_DEFAULT), or, with plain_args, a
    plain server with those flags and `args` (a module whose flags change what plain decoding gives)."""
    from jetflow_sglang.paths import default_paths

    target, head = default_paths()  # the shipped GGUF, converted once

    def jetflow(mode, overlap):
        return pool.get(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                 "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens",
                                 str(budget), *args], env={"JETFLOW_OVERLAP": overlap, **NO_TRITON, **spec_env},
                        name=mode, shared=False)

    sync, overlap = jetflow("sync", "off"), jetflow("overlap", "on")
    if plain_args is None:
        plain = plain_default(pool)
    else:  # the module's own plain server; its greedy answers are read once for both scheduler modes
        plain = pool.get(target, ["--dtype", "float32", *plain_args, *args], env=NO_TRITON, name="plain", shared=False)
        plain.memo = True
    with pool.use(sync, overlap, plain) as up:
        yield (*up, str(target))


def chat_ids(target: str, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn in the target's chat template, tokenized."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=False)).input_ids for p in prompts]
