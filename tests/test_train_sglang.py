"""`scripts/regenerate.py --engine sglang` on a tiny random Qwen3 on CPU: sglang.Engine writes the same records as
the HF path (greedy, float32), resumes, and a bad setup gets one clear error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetflow_sglang.train import data as D
from tests.test_train import byte_tokenizer, tiny_target

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"gsm8k": ["What is 2+2?", "Tom has 3 apples and buys 4 more. How many now?",
                     "A much longer prompt, so that the batch needs left padding in the HF path."],
           "code": ["def f(x):", "Implement a stack in Python."]}
NEW = 12


def _target(path: Path):
    from transformers import GenerationConfig

    model = tiny_target("qwen3")
    with torch.no_grad():  # wide logit gaps: float noise between engines cannot flip a greedy choice
        model.get_output_embeddings().weight.mul_(2.0)
    model.save_pretrained(path)
    tok = byte_tokenizer()
    tok.save_pretrained(path)
    GenerationConfig(eos_token_id=1, pad_token_id=1).save_pretrained(path)
    return model, tok


def _run(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "scripts/regenerate.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_sglang_engine_regenerates_like_hf_and_resumes(tmp_path):
    pytest.importorskip("sglang")
    model, tok = _target(tmp_path / "target")
    D.save_prompts(PROMPTS, tmp_path / "p.json.gz")
    common = ["--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "p.json.gz"), "--mix",
              "gsm8k=0.5,code=0.5", "--sample-frac", "0", "--max-new-tokens", str(NEW), "--dtype", "float32",
              "--threads", "1", "--out", str(tmp_path / "sgl.jsonl")]
    sgl = ["--engine", "sglang", "--device", "cpu", "--max-total-tokens", "2048", "--max-running-requests", "4"]
    env = {"JETFLOW_SGLANG_CPU": "1"}
    # first run stops after one batch of 2 prompts; the rerun completes the rest
    p = _run(common + sgl + ["--batch-size", "2", "--tokens", "1"], env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(D.read_records(tmp_path / "sgl.jsonl")) == 2
    p = _run(common + sgl + ["--batch-size", "8", "--tokens", "100000"], env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = D.read_records(tmp_path / "sgl.jsonl")
    assert sorted(r["key"] for r in recs) == sorted(f"{s}/{i}" for s, ps in PROMPTS.items() for i in range(len(ps)))

    # the HF path over the same prompts writes the same records (chat template, continuation, EOS flag)
    hf = D.regenerate(model, tok, PROMPTS, tmp_path / "hf.jsonl", 100000, mix={"gsm8k": .5, "code": .5},
                      sample_frac=0.0, batch_size=8, max_new_tokens=NEW, progress=False)
    by_key = {r["key"]: r for r in hf}
    for r in recs:
        src, i = r["key"].split("/")
        assert r["ids"][:r["prompt_len"]] == D.chat_ids(tok, PROMPTS[src][int(i)])  # the target's chat template
        assert set(r) == set(by_key[r["key"]])  # same JSONL format
        assert r["ids"] == by_key[r["key"]]["ids"], r["key"]
        assert r["eos"] == by_key[r["key"]]["eos"] and r["mode"] == "greedy"


def test_sglang_engine_on_cpu_needs_the_switch(tmp_path):
    """Without JETFLOW_SGLANG_CPU=1 the CPU engine cannot start: one clear line, no traceback."""
    _target(tmp_path / "target")
    D.save_prompts(PROMPTS, tmp_path / "p.json.gz")
    env = {k: v for k, v in os.environ.items() if k != "JETFLOW_SGLANG_CPU"}
    p = subprocess.run([sys.executable, "scripts/regenerate.py", "--engine", "sglang", "--device", "cpu", "--target",
                        str(tmp_path / "target"), "--prompts", str(tmp_path / "p.json.gz"), "--mix",
                        "gsm8k=0.5,code=0.5", "--out", str(tmp_path / "x.jsonl")],
                       cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "JETFLOW_SGLANG_CPU=1" in p.stderr and "Traceback" not in p.stderr


def test_hf_continuer_keeps_eos_and_cuts_after_it():
    from jetflow_sglang.train.engines import cut_at_eos, model_eos_ids

    assert cut_at_eos([5, 6, 1, 7], {1}) == [5, 6, 1]
    assert cut_at_eos([5, 6], {1}) == [5, 6]
    tok = byte_tokenizer()
    model = tiny_target()
    assert model_eos_ids(model.config, model.generation_config, tok) == {1}

