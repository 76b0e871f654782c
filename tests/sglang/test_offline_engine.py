"""`sglang.Engine` (SGLang's offline Python API, no HTTP server) with `speculative_algorithm="JETFLOW"`, on a tiny random
Qwen3 target with a tiny head: a mixed greedy + sampled batch with logprobs, and a streamed request. Greedy output
equals HF's (float32), its logprobs equal HF's log-softmax, and the rounds verified drafts. Runs in a subprocess:
the engine spawns its scheduler, and JETFLOW_SGLANG_CPU=1 has to be set when the interpreter starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.sglang.sgl_fixtures import _build_tiny, build_tiny_head

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "def fib(n):", "1 2 3 4 5"]
NEW = 16
SCRIPT = """
import json, sys
import sglang

def main():
    target, head, out = sys.argv[1:4]
    engine = sglang.Engine(model_path=target, speculative_algorithm="JETFLOW", speculative_draft_model_path=head,
                           speculative_num_draft_tokens=6, device="cpu", dtype="float32", max_total_tokens=2048,
                           max_running_requests=4, log_level="error")
    try:
        greedy = {"max_new_tokens": %(new)d, "temperature": 0, "ignore_eos": True}
        sampled = {"max_new_tokens": %(new)d, "temperature": 0.9, "ignore_eos": True}
        prompts = %(prompts)r
        res = engine.generate(prompts + prompts[:1], [greedy] * len(prompts) + [sampled], return_logprob=True)
        stream = list(engine.generate(prompts[1], greedy, stream=True))
    finally:
        engine.shutdown()
    json.dump({"batch": [{"ids": r["output_ids"], "lp": [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                          "verify": r["meta_info"].get("spec_verify_ct", 0)} for r in res],
               "stream_text": stream[-1]["text"], "stream_chunks": len(stream)}, open(out, "w"))

if __name__ == "__main__":
    main()
""" % {"new": NEW, "prompts": PROMPTS}


def test_offline_engine_serves_jetflow_identical_to_hf(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _build_tiny(tmp_path / "target", "Qwen3", 0)
    head = build_tiny_head(target, tmp_path / "head")
    (tmp_path / "run.py").write_text(SCRIPT)
    env = {**os.environ, "JETFLOW_SGLANG_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(target), str(head), str(tmp_path / "out.json")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for prompt, r in zip(PROMPTS, got["batch"]):
        ids = tok(prompt).input_ids
        with torch.no_grad():  # the greedy continuation's logits, one forward
            logits = model(torch.tensor([ids + r["ids"]])).logits[0, len(ids) - 1:-1]
        want = logits.argmax(-1).tolist()
        assert r["ids"] == want, prompt  # HF greedy: each token the argmax after the previous ones
        lp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(want)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(r["lp"], lp.tolist())) < 1e-3, prompt
        assert r["verify"] > 0
    assert len(got["batch"][-1]["ids"]) == NEW  # the sampled one
    assert got["stream_text"] == tok.decode(got["batch"][1]["ids"], skip_special_tokens=True)
