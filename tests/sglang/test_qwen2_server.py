"""A Qwen2 (= Qwen2.5 architecture) target behind `--speculative-algorithm JETFLOW`: SGLang 0.5.23's qwen2 model has
no set_dflash_layers_to_capture; the plugin adds it in memory. Output must equal HF greedy (float32)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.sglang.sgl_fixtures import hf_greedy, tiny_jetflow_server  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "def fib(n):", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    for srv, target in tiny_jetflow_server(tmp_path_factory.mktemp("qwen2"), "Qwen2", 6):
        yield srv, str(target)


def test_qwen2_target_serves_jetflow_identical_to_hf(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv, target = setup
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for p in PROMPTS:
        ids = tok(p).input_ids
        out = srv.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert out["output_ids"] == hf_greedy(model, ids, 24, stop_at_eos=False), p
        assert out["meta_info"]["spec_verify_ct"] > 0  # it went through JETFLOW verify rounds with captured taps
    assert "added set_dflash_layers_to_capture to Qwen2ForCausalLM" in Path(srv.log).read_text(errors="replace")
