"""`jetflow generate` as a user runs it: real output on a tiny local model, and clear errors for bad input."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "sglang"))
from sgl_fixtures import build_tiny_head, build_tiny_qwen3  # noqa: E402  (plain torch/transformers builders)

from jetflow_sglang.cli import main  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = build_tiny_qwen3(root / "target")
    head = build_tiny_head(target, root / "head")
    return str(target), str(head), root


def run_cli(capsys, *args):
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_is_lossless_and_reports(stack, capsys):
    target, head, _ = stack
    code, out, err = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--budget", "8",
                             "--max-new-tokens", "24", "--compare-ar", "--json", "--threads", "1",
                             "--dtype", "float32")
    assert code == 0, err
    res = json.loads(out)
    assert res["lossless"] is True and res["new_tokens"] >= 1
    assert {"text", "tau", "tokens_per_s", "speedup_vs_ar"} <= set(res)
    assert res["tau"] >= 1.0 and res["speedup_vs_ar"] > 0
    # the same text as --budget 1
    code, out1, _ = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--budget", "1",
                            "--max-new-tokens", "24", "--json", "--threads", "1", "--dtype", "float32")
    assert json.loads(out1)["text"] == res["text"]


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget must be"),
    (["--budget", "513"], "budget must be"),
    (["--budget", "many"], "budget"),
])
def test_argument_errors(stack, capsys, args, message):
    target, head, _ = stack
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--target", target, "--head", head, *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_input_errors(stack, capsys, tmp_path):
    target, head, root = stack
    cases = [
        (["   "], "the prompt is empty"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["word " * 600], "the model's context is"),
        (["hi", "--head", str(tmp_path / "missing")], "no draft-head checkpoint"),
    ]
    other = tmp_path / "other-head"  # a head for a different target
    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, save_head
    save_head(JetFlowHead(JetFlowHeadConfig.for_target(tiny_model("llama").config)), other)
    cases.append((["hi", "--head", str(other)], "built for another target"))
    import torch
    if not torch.cuda.is_available():  # asking for a GPU that is not there is bad input too
        cases.append((["hi", "--device", "cuda"], "sees no CUDA device"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(Path(head, "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 100)
    cases.append((["hi", "--head", str(corrupt)], "corrupt"))
    for args, message in cases:
        argv = args if args[0] != "--temperature" else ["hi", *args]
        code, out, err = run_cli(capsys, *argv, "--target", target, "--head", head, "--max-new-tokens", "4") \
            if "--head" not in argv else run_cli(capsys, *argv, "--target", target, "--max-new-tokens", "4")
        assert code == 2 and message in err, (args, err)
        assert "Traceback" not in err
