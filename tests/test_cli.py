"""`jetflow generate` as a user runs it: real output on a tiny local model, and clear errors for bad input.

Every bad input is one line on stderr and exit code 2; those that need no model are checked before any is loaded
(`no_loading` makes loading a model an error in those tests)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang.sgl_fixtures import build_tiny_head, build_tiny_qwen3  # noqa: E402  (plain torch/transformers builders)

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
    # the default budget is auto: it measures this machine's verify cost, adapts, and stays lossless
    code, out2, err2 = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--max-new-tokens",
                               "24", "--json", "--threads", "1", "--dtype", "float32", "--compare-ar")
    auto = json.loads(out2)
    assert code == 0 and auto["budget"] == "auto" and auto["lossless"] is True and auto["text"] == res["text"]
    assert auto["mean_budget"] >= 1 and "budget=auto (mean" in err2


def test_graphs_check_replays_the_tree_build_losslessly(stack, capsys):
    """--graphs check: the tree build replayed from one capture per shape (on a CPU, the replayed ATen trace), each
    replay compared with the eager build; the text is plain decoding's."""
    target, head, _ = stack
    code, out, err = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--budget", "8",
                             "--max-new-tokens", "24", "--compare-ar", "--json", "--threads", "1",
                             "--dtype", "float32", "--graphs", "check")
    assert code == 0, err
    res = json.loads(out)
    assert res["lossless"] is True and res["graphs"]["backend"] == "fx", res
    assert res["graphs"]["replays"] >= res["verify_steps"] - 1 > 0 and res["graphs"]["captures"] >= 1, res
    assert "fx captures (each equal to eager)" in err


@pytest.fixture
def no_loading(monkeypatch):
    """Loading target weights is a test failure: these errors must come first."""
    from jetflow_sglang.engine.target import Target

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was rejected")
    monkeypatch.setattr(Target, "from_pretrained", refuse)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget must be"),
    (["--budget", "513"], "budget must be"),
    (["--budget", "many"], "budget"),
    (["--budget", "abc"], "budget must be an integer in [1, 512] or 'auto'; got 'abc'"),
    (["--width=-3"], "--width: must be an integer >= 1; got '-3'"),
    (["--width", "0"], "--width: must be an integer >= 1"),
    (["--threads=-1"], "--threads: must be an integer >= 0"),
    (["--device", "tpu"], "device must be cpu, cuda or cuda:N; got 'tpu'"),
    (["--temperature", "inf"], "--temperature: must be a finite number"),
    (["--temperature", "nan"], "--temperature: must be a finite number"),
    (["--top-p", "nan"], "--top-p: must be a finite number"),
    (["--depth", "0"], "--depth: must be an integer >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    (["--tree", "best"], "--tree: invalid choice"),
])
def test_argument_errors(no_loading, capsys, tmp_path, args, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--target", str(tmp_path / "none"), "--head", str(tmp_path / "none"), *args])
    assert e.value.code == 2 and message in one_line(capsys.readouterr().err)


def test_invalid_utf8_prompt(no_loading, capsys, tmp_path):
    code, _, err = run_cli(capsys, "caf\udce9 au lait", "--target", str(tmp_path / "none"))  # argv byte 0xe9 (latin-1)
    assert code == 2 and "the prompt is not valid UTF-8 (byte 0xe9 at character 3)" in one_line(err)


def test_invalid_utf8_prompt_from_a_real_argv(tmp_path):
    """The bytes as a shell passes them: Python turns them into surrogates, the CLI says so in one line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "jetflow_sglang.cli", "generate", b"bad \xff\xfe bytes",
                        "--target", str(tmp_path / "none")], capture_output=True, env=env, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    err = r.stderr.decode()
    assert r.returncode == 2 and "not valid UTF-8 (byte 0xff at character 4)" in one_line(err)


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


def _own_head_variant(head: str, out: Path, **changes) -> str:
    """A copy of the tiny head with config.json fields changed (weights untouched)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(Path(head, "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").write_bytes(Path(head, "model.safetensors").read_bytes())
    return str(out)


def test_head_and_config_errors_before_loading(stack, no_loading, capsys, tmp_path):
    from transformers import AutoConfig

    from tests.test_head_formats import write_release

    target, head, _ = stack
    tcfg = AutoConfig.from_pretrained(target)
    list_target = tmp_path / "list-target"
    list_target.mkdir()
    (list_target / "config.json").write_text("[1, 2]")
    narrow = write_release(tmp_path / "narrow", tcfg, causal=True, taps=(1, 2), hidden_size=32)[0]
    bidir = write_release(tmp_path / "bidir", tcfg, causal=False, taps=(1, 2))[0]
    listed = _own_head_variant(head, tmp_path / "list")
    Path(listed, "config.json").write_text(json.dumps([json.loads(Path(head, "config.json").read_text())]))
    cases = [
        (["--head", listed], "expected a JSON object, found a list"),
        (["--target", str(list_target)], "expected a JSON object, found a list"),
        (["--head", str(narrow)], "hidden_size: head expects 32, target has 64"),
        (["--head", _own_head_variant(head, tmp_path / "tap", tap_layers=[-1, 2])], "tap_layers[0] must be an integer >= 0"),
        (["--head", _own_head_variant(head, tmp_path / "tap9", tap_layers=[1, 9])], "tap layers [9] of [1, 9] do not exist"),
        (["--head", _own_head_variant(head, tmp_path / "bs0", block_size=0)], "block_size must be an integer >= 2"),
        (["--head", head, "--drafter", "ddtree"], "drafter 'ddtree' needs a bidirectional head, but this head is causal"),
        (["--head", str(bidir), "--drafter", "jetflow"], "drafter 'jetflow' needs a causal head"),
        (["--head", _own_head_variant(head, tmp_path / "unknown", colour="blue")], "unknown field(s) colour"),
    ]
    for args, message in cases:
        argv = ["hi", "--target", target, *args] if "--target" not in args else ["hi", "--head", head, *args]
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in one_line(err), (args, err)


def test_head_weights_of_another_size(stack, no_loading, capsys, tmp_path):
    """Config fine, weights from a wider head: one line naming the tensor (no size-mismatch dump)."""
    from safetensors.torch import load_file, save_file

    target, head, _ = stack
    out = Path(_own_head_variant(head, tmp_path / "wide"))
    state = load_file(str(out / "model.safetensors"))
    state["layers.0.q_proj.weight"] = state["layers.0.q_proj.weight"].repeat(2, 1)
    save_file(state, str(out / "model.safetensors"))
    code, _, err = run_cli(capsys, "hi", "--target", target, "--head", str(out))
    assert code == 2 and "head tensor layers.0.q_proj.weight" in one_line(err) and "implies (64, 64)" in err


@pytest.mark.parametrize("causal", [True, False])
def test_released_heads_generate_losslessly(stack, capsys, tmp_path, causal):
    """A JetFlow release (causal) runs the jetflow drafter, a DFlash release (bidirectional) ddtree, picked from
    config.json; both give the autoregressive text in float32."""
    from transformers import AutoConfig

    from tests.test_head_formats import write_release

    target, _, _ = stack
    head = write_release(tmp_path / "release", AutoConfig.from_pretrained(target), causal=causal, taps=(1, 2))[0]
    code, out, err = run_cli(capsys, "The quick brown fox", "--target", target, "--head", str(head), "--budget", "6",
                             "--max-new-tokens", "12", "--compare-ar", "--json", "--threads", "1", "--dtype", "float32")
    assert code == 0, err
    res = json.loads(out)
    assert res["drafter"] == ("jetflow" if causal else "ddtree")
    assert res["lossless"] is True and res["new_tokens"] >= 1 and res["divergence"] is None


def test_compare_ar_names_the_first_difference(stack, capsys, monkeypatch):
    """When the texts differ, --compare-ar says where (position, both tokens) and the target's top-2 margins there."""
    from jetflow_sglang.engine import loop as engine

    real = engine.autoregressive

    def altered(target, ids, **kw):  # an AR run that differs from the speculative one at new token 2
        res = real(target, ids, **kw)
        if len(res.tokens) > 2:
            res.tokens[2] = (res.tokens[2] + 1) % target.config.vocab_size
        return res
    monkeypatch.setattr(engine, "autoregressive", altered)
    target, head, _ = stack
    code, out, err = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--budget", "4",
                             "--max-new-tokens", "6", "--compare-ar", "--json", "--threads", "1", "--dtype", "float32")
    assert code == 0, err
    res = json.loads(out)
    assert res["lossless"] is False and res["divergence"]["position"] == 2
    assert res["divergence"]["a_token"] == res["tokens"][2] != res["divergence"]["b_token"]
    assert "first difference at new token 2" in err and "target top-2 logit margin there" in err


def test_tree_and_depth_options(stack, capsys, monkeypatch):
    target, head, _ = stack
    code, out, err = run_cli(capsys, "The quick brown fox", "--target", target, "--head", head, "--budget", "8",
                             "--tree", "paper", "--depth", "3", "--max-new-tokens", "12", "--compare-ar", "--json",
                             "--threads", "1", "--dtype", "float32")
    assert code == 0, err
    res = json.loads(out)
    assert (res["tree"], res["depth"], res["lossless"]) == ("paper", 3, True)
    # deeper than the head's block (8 slots: 7 draft depths): one line, before the model loads
    from jetflow_sglang.engine.target import Target
    monkeypatch.setattr(Target, "from_pretrained", lambda *a, **k: pytest.fail("loaded before checking --depth"))
    code, _, err = run_cli(capsys, "hi", "--target", target, "--head", head, "--depth", "9")
    assert code == 2 and "depth must be an integer in [1, 7]" in one_line(err)


def test_lookup_is_on_by_default_and_can_be_turned_off(stack, capsys):
    target, head, _ = stack
    prompt = "one two three one two three one two three one two"  # repeats itself: the lookup trie drafts it
    common = ["--target", target, "--head", head, "--budget", "8", "--max-new-tokens", "24", "--compare-ar", "--json",
              "--threads", "1", "--dtype", "float32"]
    code, out, err = run_cli(capsys, prompt, *common)
    assert code == 0, err
    on = json.loads(out)
    assert on["lookup"] is True and on["drafter"] == "jetflow" and on["lossless"] is True
    assert "jetflow+lookup budget=8" in err
    code, out, err = run_cli(capsys, prompt, *common, "--no-lookup")
    off = json.loads(out)
    assert code == 0 and off["lookup"] is False and off["drafter"] == "jetflow" and off["lossless"] is True
    assert off["tokens"] == on["tokens"]
    code, out, err = run_cli(capsys, prompt, *common, "--drafter", "ngram")  # no head: nothing to merge into
    assert code == 0 and json.loads(out)["drafter"] == "ngram"
