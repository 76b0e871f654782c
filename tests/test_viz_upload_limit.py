"""The explorer refuses uploads over jetflow_sglang.viz.app.MAX_UPLOAD_BYTES: the real app
(`python -m jetflow_sglang.viz`, as `jetflow-explorer` starts it) on 127.0.0.1 answers 413 to a file one byte over the
limit and keeps nothing of it in its upload folder; a file of exactly the limit, and a small exported run, are
accepted."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from jetflow_sglang.viz.app import MAX_UPLOAD_BYTES

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # a real explorer process (about 30 s to start on a busy 2-core machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from tests.sglang.sgl_fixtures import build_tiny_head, build_tiny_qwen3

    tmp = tmp_path_factory.mktemp("upload")
    target = build_tiny_qwen3(tmp / "target")
    head = build_tiny_head(target, tmp / "head")
    uploads, results = tmp / "gradio-uploads", tmp / "results"
    uploads.mkdir()
    results.mkdir()
    port = _free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1", GRADIO_TEMP_DIR=str(uploads))
    log = open(tmp / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jetflow_sglang.viz", "--target", str(target), "--head", str(head),
                             "--results", str(results), "--dtype", "float32", "--port", str(port), "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300
    try:
        while True:
            try:
                if requests.get(url, timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the explorer did not start:\n{(tmp / 'app.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, uploads
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _upload(url: str, name: str, data: bytes) -> requests.Response:
    return requests.post(url + "gradio_api/upload", files={"files": (name, data, "application/json")}, timeout=300)


def test_the_page_knows_the_limit(app):
    url, _ = app
    assert requests.get(url + "config", timeout=30).json()["max_file_size"] == MAX_UPLOAD_BYTES


def test_an_upload_over_the_limit_is_refused_and_nothing_stays(app):
    url, uploads = app
    before = _files(uploads)
    r = _upload(url, "too-big.json", b" " * (MAX_UPLOAD_BYTES + 1))
    assert r.status_code == 413, (r.status_code, r.text[:500])
    assert f"maximum allowed size of {MAX_UPLOAD_BYTES} bytes" in r.text
    time.sleep(0.5)  # nothing is moved in the background either
    assert _files(uploads) == before


def test_uploads_up_to_the_limit_are_accepted(app):
    from jetflow_sglang.viz.export import FORMAT

    url, uploads = app
    run = ('{"format": "%s", "prompt": "hi", "settings": {"drafter": "jetflow", "budget": 4}, "rounds": []}'
           % FORMAT).encode()
    for name, data in (("run.json", run), ("at-limit.json", b" " * MAX_UPLOAD_BYTES)):
        r = _upload(url, name, data)
        assert r.status_code == 200, (r.status_code, r.text[:500])
        (path,) = r.json()
        deadline = time.time() + 30  # Gradio moves the file into its cache in a background task
        while not Path(path).is_file() and time.time() < deadline:
            time.sleep(0.2)
        assert Path(path).is_relative_to(uploads) and Path(path).stat().st_size == len(data)
        if name == "run.json":
            assert Path(path).read_bytes() == run
            from jetflow_sglang.viz.export import load_run

            assert load_run(path).prompt == "hi"
