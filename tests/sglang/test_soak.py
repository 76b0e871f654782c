"""The soak benchmark's CI version: scripts/soak_server.py with 40 mixed requests (greedy / sampled, /generate and
the OpenAI routes, streaming, logprobs, regex / JSON-schema, penalties, stop strings, n=2, aborts, dropped clients)
at concurrency 8 against a JETFLOW server (JETFLOW_BUDGET=auto) and a plain server on a tiny random Qwen3 with a tiny
head, float32 on the CPU: no errors, every greedy output identical, the head pool back to its baseline after a
flush."""
from __future__ import annotations

import json
import os

import pytest

from tests.scripts import load_script  # noqa: E402
from tests.sglang.sgl_fixtures import shared_head, shared_tiny  # noqa: E402

if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":  # the lite install: bash scripts/install_sglang_cpu.sh .venv
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PLAIN_RUN: list = []  # the first run's JSON: the plain server's answers do not depend on JETFLOW's scheduler mode


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_soak_40_requests(tmp_path, monkeypatch, overlap):
    soak_server = load_script("soak_server")

    # SGLang compiles two sampling helpers with torch.compile on first use (repetition penalty, seeded sampling): a
    # scheduler stop of ~1 min each on a CPU, which the full soak warms up; here the servers run them eagerly.
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    target = shared_tiny()
    head = shared_head(target)
    out = tmp_path / "soak"
    rc = soak_server.main(["--target", str(target), "--head", str(head), "--requests", "40", "--concurrency", "8",
                           "--max-new-tokens", "24", "--max-prompt-chars", "160",  # the tiny model's context: 512
                           "--max-total-tokens", "4096", "--max-minutes", "8", "--sample-s", "2", "--together",
                           "--overlap", overlap, *(["--plain-from", PLAIN_RUN[0]] if PLAIN_RUN else []),
                           "--out", str(out)])
    res = json.loads(out.with_suffix(".json").read_text())
    if res.get("passed") and not PLAIN_RUN and not res["meta"].get("plain_from"):
        PLAIN_RUN.append(str(out.with_suffix(".json")))
    assert res["errors"] == [], res["errors"]
    assert not res.get("truncated"), res["truncated"]  # all 40 ran on both servers
    assert res["greedy_mismatches"] == [], res["greedy_mismatches"]
    assert res["greedy_compared"] >= 15
    assert set(res["mix"]) == set(soak_server.KINDS)  # every kind of request at least once
    jf = res["phases"]["jetflow"]
    base, after = jf["checkpoints"][0], jf["checkpoints"][-1]
    assert (base["at"], after["at"]) == ("start", "after_flush")
    assert after["head_pool_used"] == base["head_pool_used"], jf["checkpoints"]
    assert max(c["head_pool_used"] for c in jf["checkpoints"]) > base["head_pool_used"]  # it was used meanwhile
    assert jf["pool_back_to_baseline"] is True and res["passed"] and rc == 0
    recs = [r for p in res["phases"].values() for r in p["records"].values()]
    assert any(r["aborted"] for r in recs) and any(r["dropped"] for r in recs)
    assert out.with_suffix(".png").stat().st_size > 0 and "PASS" in out.with_suffix(".md").read_text()
