"""Released head formats on a real server: `--speculative-draft-model-path` pointing at a JetFlow release (causal)
or a DFlash release (bidirectional) of a tiny Qwen3, on CPU, gives HF greedy's tokens through JETFLOW verify rounds."""
from __future__ import annotations

import os

import pytest
import torch

from tests.sglang.sgl_fixtures import build_tiny_qwen3, hf_greedy  # noqa: E402
from tests.sglang.sgl_server import Server  # noqa: E402

from tests.test_head_formats import write_release  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)
import sglang  # noqa: E402,F401

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "def fib(n):"]


@pytest.mark.parametrize("release, drafter", [("jetflow", "jetflow"), ("dflash", "ddtree")])
def test_released_head_serves_losslessly(tmp_path, release, drafter):
    from transformers import AutoConfig, AutoTokenizer

    target = build_tiny_qwen3(tmp_path / "target")
    head = write_release(tmp_path / release, AutoConfig.from_pretrained(target), causal=release == "jetflow",
                         taps=(1, 2))[0]
    log = tmp_path / "server.log"
    server = Server(str(target), ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                  "--speculative-draft-model-path", str(head), "--speculative-num-draft-tokens", "6"],
                    log, env={"JETFLOW_DRAFTER": drafter})
    try:
        server.wait_ready()
        tok = AutoTokenizer.from_pretrained(target)
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out = server.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 16})
            assert out["output_ids"] == hf_greedy(str(target), ids, 16), prompt
            assert out["meta_info"]["spec_verify_ct"] > 0
        assert f"drafter={drafter}" in log.read_text()
    finally:
        server.stop()
