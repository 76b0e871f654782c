"""The CPU hyper-parameter ablation runner (`python -m jetflow_sglang.train.ablate`) on a tiny random target: every
arm trains from the same init and reports finite held-out proxies, and a rerun resumes by arm."""
import json

import torch

from jetflow_sglang.train import ablate
from tests.test_train import byte_tokenizer, tiny_target


def test_ablation_runs_arms_and_resumes(tmp_path):
    target = tmp_path / "target"
    tiny_target("qwen3").save_pretrained(target)
    byte_tokenizer().save_pretrained(target)
    gsm = tmp_path / "train.jsonl"
    with open(gsm, "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"What is {i} plus {3 * i}? Show the steps.",
                                "answer": f"{i} plus {3 * i} is {4 * i}, because adding {3 * i} to {i} gives "
                                          f"{4 * i}.\n#### {4 * i}"}) + "\n")
    out = tmp_path / "ablate"
    args = ["--out", str(out), "--target", str(target), "--gsm8k", str(gsm), "--sequences", "6", "--held-out", "2",
            "--steps", "3", "--seqs", "1", "--blocks", "2"]
    ablate.main([*args, "--arms", "base,base-seed1"])
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in rows] == ["base", "base-seed1"]
    assert rows[1]["seed"] == 1 and rows[0]["seed"] == 0
    assert all(torch.isfinite(torch.tensor(r["eval_kl"])) and r["eval_blocks"] > 0 for r in rows)
    assert rows[0]["eval_kl"] != rows[1]["eval_kl"]  # another init and batch order

    ablate.main([*args, "--arms", "base,layers3"])  # base is done: only the new arm runs
    rows2 = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in rows2] == ["base", "base-seed1", "layers3"] and rows2[:2] == rows
    assert rows2[2]["layers"] == 3
    table = (out / "results.md").read_text().splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| base | - |") and "layers=3" in table[4]
