"""One pool of real SGLang servers for the whole test session.

A launch is a key: (model, flags, environment). The first module that asks for a launch starts it; every later module
that asks for the same launch gets the same running server, so a server that several modules need starts once per
session instead of once per module. A module holds its servers while it runs (`use`); a shared server nobody holds
stays up (idle: --sleep-on-idle) until the session ends, or until starting another would pass MAX_LIVE live servers
or leave too little memory (sgl_server.make_room), when the least recently used idle one is stopped; a server `get`
handed out counts as held from then on, so that the next start of the same fixture cannot stop it before `use` holds
it, and a held server whose process died starts again (on a new port) when `use` waits for it; a module's own launch
(shared=False) stops when the module lets go of it. Plain references memoise their greedy answers
(`PooledServer.memo`): every module and scheduler mode that compares against the same request reads one answer.

Modules whose tests change a server's state (weights, pause, flushed caches on purpose, killed processes) keep their
own servers; servers from the pool serve requests only.

Under pytest-xdist (JETFLOW_TEST_WORKERS=2 bash scripts/test.sh: whole modules per worker) every worker has its own
pool; a start that would leave less than sgl_server.MIN_AVAILABLE memory first stops this pool's idle servers, then
waits for the other worker's.
"""
from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from pathlib import Path

from tests.sglang import sgl_server
from tests.sglang.sgl_server import Server

MAX_LIVE = int(os.environ.get("JETFLOW_TEST_MAX_SERVERS", "6"))  # a tiny server takes about 2.5 GB; SmolLM2 ~3.5 GB


def _greedy(body: dict) -> bool:
    """A request whose answer is fixed by its body: every sampling_params at temperature 0."""
    params = body.get("sampling_params")
    params = params if isinstance(params, list) else [params]
    return all(isinstance(p, dict) and p.get("temperature", 1.0) == 0 for p in params) and not body.get("stream")


class PooledServer(Server):
    """A Server of the pool. With `memo` (the plain references), a greedy /generate body it has answered before is
    answered from memory: every module and scheduler mode that compares against it reads one answer."""

    def __init__(self, model, args, log, env=None, **kwargs):
        super().__init__(model, args, log, env=env, **kwargs)
        self.env_extra = env
        self.users = 0  # modules holding it (`ServerPool.use`)
        self.pending = 0  # handed out by `get` and not yet held: not idle, so that no start in between stops it
        self.restarts = 0
        self.shared = True
        self.ready = False
        self.memo = False
        self._answers: dict = {}

    def hold(self) -> None:
        self.users += 1
        self.pending = max(0, self.pending - 1)

    def wait_ready(self) -> "PooledServer":
        if self.ready and self.proc.poll() is not None:  # it died since it was last ready (a test says why): again
            self.stop()
            self.restarts += 1
            self.ready = False
            self._start()
        if not self.ready:
            super().wait_ready()
            self.ready = True
        return self

    def generate(self, timeout: float = 300, **body) -> dict:
        if not (self.memo and _greedy(body)):
            return super().generate(timeout=timeout, **body)
        key = json.dumps(body, sort_keys=True)
        if key not in self._answers:
            self._answers[key] = super().generate(timeout=timeout, **body)
        return copy.deepcopy(self._answers[key])


class ServerPool:
    def __init__(self, root: Path, max_live: int = MAX_LIVE):
        self.root, self.max_live = Path(root), max_live
        self.live: dict[tuple, PooledServer] = {}  # in order of last use, most recent last
        self.starts: list[str] = []  # every start, for the session's report
        self.reuses = 0  # gets answered by a server that was already up
        self._lock = sgl_server.GATE  # a start under `get` calls `_evict_one` (sgl_server.make_room): one lock
        sgl_server.EVICTORS.append(self._evict_one)

    @staticmethod
    def key(model, args, env, spawn: bool = False) -> tuple:
        env = tuple(sorted((env or {}).items()))
        return str(model), tuple(str(a) for a in args), env, spawn or sgl_server.SPAWN_ALL

    def get(self, model, args: list[str], env: dict | None = None, name: str = "server",
            shared: bool = True, spawn: bool = False) -> PooledServer:
        """The pool's server for this launch, started (not waited for) if it is not up. shared=False: a launch only
        this module makes; it stops when the module lets go of it (`use`). spawn: launched as users do
        (sgl_server.Server)."""
        key = self.key(model, args, env, spawn)
        with self._lock:
            srv = self.live.pop(key, None)
            if srv is not None and srv.proc.poll() is not None:  # it died: a test will have said so; start again
                srv.stop()
                srv = None
            if srv is not None:
                self.reuses += 1
            else:
                self._make_room()
                log = self.root / f"{len(self.starts):02d}-{name}.log"
                srv = PooledServer(str(model), list(args), log, env=env, spawn=spawn)
                srv.shared = shared
                self.starts.append(f"{name}: {model} {' '.join(map(str, args))} {dict(env or {})}")
            srv.pending += 1
            self.live[key] = srv
            return srv

    def _make_room(self) -> None:
        """At most max_live live servers; memory is every start's own check (sgl_server.make_room), which asks
        `_evict_one` for room."""
        while len(self.live) >= self.max_live and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Stop the least recently used server nobody holds or was handed (`get`) without holding it yet."""
        with self._lock:
            idle = [k for k, s in self.live.items() if s.users == 0 and s.pending == 0]
            if not idle:
                return False
            self.live.pop(idle[0]).stop()
            return True

    @contextmanager
    def use(self, *servers: PooledServer):
        """Hold the servers (ready) while the block runs; they stay up for later users afterwards."""
        for s in servers:
            s.hold()
        try:
            yield tuple(s.wait_ready() for s in servers)
        finally:
            for s in servers:
                s.users -= 1
                if s.users == 0 and not s.shared:
                    self.live.pop(self.key(s._model, s._args, s.env_extra, s.spawn), None)
                    s.stop()

    def stop_all(self) -> None:
        if self._evict_one in sgl_server.EVICTORS:
            sgl_server.EVICTORS.remove(self._evict_one)
        for srv in self.live.values():
            srv.stop()
        self.live.clear()
