"""The TRAINING.md recipe on targets beyond SmolLM2: tiny random Qwen2 and Qwen3 HF folders get heads from
`scripts/train_head.py`, and `jetflow generate` (the installed CLI, as a user runs it) drafts with them losslessly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetflow_sglang.train import data as D
from tests.test_train import byte_tokenizer, tiny_target

PROMPTS = {"gsm8k": [f"Question {i}: what is {i} plus {2 * i}?" for i in range(8)]}


def _folder(arch: str, path: Path):
    from transformers import GenerationConfig

    model = tiny_target(arch)
    model.save_pretrained(path)
    tok = byte_tokenizer()
    tok.save_pretrained(path)
    GenerationConfig(eos_token_id=1, pad_token_id=1).save_pretrained(path)
    return model, tok


def _cli(*args):
    jetflow = Path(sys.executable).with_name("jetflow")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([str(jetflow), "generate", *args], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_recipe_trains_heads_that_jetflow_generate_loads(arch, tmp_path):
    from tests.scripts import load_script

    model, tok = _folder(arch, tmp_path / "target")
    D.regenerate(model, tok, PROMPTS, tmp_path / "regen.jsonl", 100000, mix={"gsm8k": 1.0}, sample_frac=0.25,
                 batch_size=8, max_new_tokens=40, progress=False)
    train_head = load_script("train_head")
    head = tmp_path / "head"
    train_head.main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "regen.jsonl"),
                     "--run", str(tmp_path / "run"), "--steps", "6", "--minutes", "0", "--vocab", "128",
                     "--taps", "3", "--seqs", "2", "--blocks", "4", "--eval-every", "6", "--eval-frac", "0.2",
                     "--threads", "1", "--out-causal", str(head), "--out-bidir", str(head) + "-bidir"])
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["target"]["model_type"] == arch and cfg["tap_layers"] == [1, 2, 3]  # default rule, 6 layers
    assert cfg["qk_norm"] == (arch == "qwen3") and cfg["extra"]["steps"] == 6
    prompt = "Question 9: what is 9 plus 18?"
    for drafter in (["jetflow"] if arch == "qwen3" else ["jetflow", "ddtree"]):
        out = _cli(prompt, "--target", str(tmp_path / "target"), "--head", str(head), "--drafter", drafter,
                   "--budget", "8", "--max-new-tokens", "16", "--dtype", "float32", "--compare-ar", "--json",
                   "--threads", "1")
        assert out["drafter"].startswith(drafter) and out["new_tokens"] > 0
        assert out["lossless"] is True and out["tau"] >= 1.0
