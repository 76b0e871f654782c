"""The test launcher itself (sgl_server.Server): ports outside the kernel's ephemeral range, and a restart on another
port when the server could not bind its own (a --tp 2 server's gloo sockets once took the port between free_port()
and uvicorn's bind; the process stayed up and the test waited 420 s for nothing)."""
from __future__ import annotations

import os
import signal
import sys
import textwrap

import requests

from tests.sglang import sgl_server  # noqa: E402
from tests.sglang.sgl_server import Server, free_port  # noqa: E402

# Stands in for `python -m sglang.launch_server`: the first launch logs uvicorn's bind error and stays up, the second
# serves /model_info and /health on the port it was given.
FAKE = textwrap.dedent("""
    import http.server, sys, time
    from pathlib import Path
    port = int(sys.argv[sys.argv.index("--port") + 1])
    marker = Path(sys.argv[sys.argv.index("--marker") + 1])
    if not marker.exists():
        marker.write_text("started once")
        print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
              "address already in use", flush=True)
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_free_port_is_below_the_ephemeral_range():
    low = sgl_server._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports) and len(ports) > 1


def test_a_port_taken_before_the_server_binds_is_retried(tmp_path, monkeypatch):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE)
    marker = tmp_path / "marker"

    monkeypatch.setattr(Server, "_command",  # the fake in place of sglang.launch_server
                        lambda self: [sys.executable, str(fake), "--port", str(self.port), "--marker", str(marker)])
    srv = Server("unused", [], tmp_path / "server.log", timeout=60)
    first = srv.proc
    try:
        assert srv.wait_ready() is srv
        assert srv.proc is not first and first.poll() is not None  # the stuck first launch was stopped
        assert marker.read_text() == "started once"
    finally:
        srv.stop()
    assert "closed file" not in srv.tail()  # tail works after stop (it used to raise and hide the server's log)


# -- the session's server pool (pool.py) ------------------------------------------------------------------------------
def _fake_launches(tmp_path, monkeypatch):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE)
    marker = tmp_path / "marker"
    marker.write_text("serve at once")
    monkeypatch.setattr(Server, "_command",
                        lambda self: [sys.executable, str(fake), "--port", str(self.port), "--marker", str(marker)])
    monkeypatch.setattr(sgl_server, "MEMORY_WAIT_S", 0)


def test_a_server_handed_out_is_not_stopped_to_make_room_for_the_next(tmp_path, monkeypatch):
    """A fixture takes the idle shared reference, then starts its own server while memory is short: the reference
    it holds must stay up (CI 2026-12-07: the pool stopped it, and three tests met 'connection refused')."""
    from tests.sglang.pool import ServerPool

    _fake_launches(tmp_path, monkeypatch)
    pool = ServerPool(tmp_path, max_live=6)
    try:
        ref = pool.get("ref", [], name="ref")
        with pool.use(ref):  # an earlier module's use: afterwards it is idle
            pass
        stale = pool.get("stale", [], name="stale")
        with pool.use(stale):
            pass
        monkeypatch.setattr(sgl_server, "effective_available", lambda: 0)  # memory is short from here on
        again = pool.get("ref", [], name="ref")
        assert again is ref
        own = pool.get("own", [], name="own", shared=False)
        assert stale.proc.poll() is not None and ref.proc.poll() is None  # the idle one made room, not the handed one
        with pool.use(ref, own) as (a, b):
            assert requests.get(a.url + "/health", timeout=5).ok and requests.get(b.url + "/health", timeout=5).ok
    finally:
        pool.stop_all()


def test_a_pooled_server_that_died_starts_again_when_used(tmp_path, monkeypatch):
    from tests.sglang.pool import ServerPool

    _fake_launches(tmp_path, monkeypatch)
    pool = ServerPool(tmp_path)
    try:
        srv = pool.get("ref", [], name="ref")
        with pool.use(srv):
            pass
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        same = pool.get("ref", [], name="ref")  # died while idle: `get` starts it again
        with pool.use(same) as (up,):
            assert requests.get(up.url + "/health", timeout=5).ok
        os.killpg(same.proc.pid, signal.SIGKILL)  # died after `get` handed it out: `use` starts it again
        same.proc.wait(timeout=30)
        with pool.use(same) as (up,):
            assert up.restarts == 1 and requests.get(up.url + "/health", timeout=5).ok
    finally:
        pool.stop_all()


def test_starts_from_several_threads_see_each_other(tmp_path, monkeypatch):
    """scripts/soak_server.py starts its servers from threads: each start's memory check reads the others' (CI
    2026-12-07: a check read a server that had no process yet and raised)."""
    import concurrent.futures as cf

    _fake_launches(tmp_path, monkeypatch)
    with cf.ThreadPoolExecutor(4) as ex:
        servers = list(ex.map(lambda i: Server("unused", [], tmp_path / f"s{i}.log", timeout=60), range(4)))
    try:
        assert sgl_server.unseen_bytes() == 4 * sgl_server.STARTING_COST  # four starts under way, each counted
        for s in servers:
            s.wait_ready()
        assert sgl_server.unseen_bytes() == 0
    finally:
        for s in servers:
            s.stop()
