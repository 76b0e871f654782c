"""`jetflow export-head` / head.export.export_head: heads written in the JetSpec (causal) and DFlash (bidirectional)
release layouts, exactly or not at all; release heads round-trip; heads trained with `train_head.py --release-layout`
export to the same draft logits."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow_sglang.cli import main
from jetflow_sglang.head import (ExportError, HeadMismatchError, JetFlowHead, JetFlowHeadConfig, export_head,
                                 load_head, save_head)
from jetflow_sglang.head.export import release_mask_token_id
from jetflow_sglang.paths import DEFAULT_HEAD_DIR, bidir_dir
from tests.helpers import tiny_model
from tests.test_head_formats import loaded_logits, write_release

torch.set_num_threads(1)


def one_line(msg: str) -> str:
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg
    return msg.strip()


def project_head(out: Path, causal=True, qk_norm=True, draft_vocab_size=0, mask_token_id=5, model_type=None):
    """A head in this project's format, built and saved here (float32), with the three layout-relevant fields set."""
    model = tiny_model("qwen3")
    model.config.architectures = [type(model).__name__]  # as the saved target's config.json names it
    cfg = JetFlowHeadConfig.for_target(model.config, causal=causal, n_taps=2, block_size=8,
                                       draft_vocab_size=draft_vocab_size)
    cfg.qk_norm, cfg.mask_token_id = qk_norm, mask_token_id
    if model_type is not None:
        cfg.target["model_type"] = model_type
    torch.manual_seed(2)
    head = JetFlowHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_head(head, out, dtype=torch.float32)
    return out, model


# ----------------------------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("head_dir, fmt", [(DEFAULT_HEAD_DIR, "jetspec"), (bidir_dir(DEFAULT_HEAD_DIR), "dflash")])
def test_shipped_heads_are_refused_naming_all_three(tmp_path, head_dir, fmt):
    with pytest.raises(ExportError) as e:
        export_head(head_dir, tmp_path / "out", fmt)
    msg = one_line(str(e.value))
    assert "qk_norm is false" in msg and "draft_vocab_size is 16384" in msg and "mask_token_id is unset" in msg
    assert "--release-layout" in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw, names, absent", [
    (dict(qk_norm=False), ["qk_norm"], ["draft_vocab_size", "mask_token_id"]),
    (dict(draft_vocab_size=16), ["draft_vocab_size is 16"], ["qk_norm", "mask_token_id"]),
    (dict(mask_token_id=None), ["mask_token_id is unset", "learned mask vector"], ["qk_norm", "draft_vocab_size"]),
])
def test_each_inexact_feature_is_refused_alone(tmp_path, kw, names, absent):
    src, _ = project_head(tmp_path / "head", **kw)
    with pytest.raises(ExportError) as e:
        export_head(src, tmp_path / "out", "jetspec")
    msg = one_line(str(e.value))
    assert all(n in msg for n in names) and not any(a in msg for a in absent), msg
    export_head(project_head(tmp_path / "ok")[0], tmp_path / "out", "jetspec")  # without it the same head exports


@pytest.mark.parametrize("causal, fmt, want", [(True, "dflash", "causal head: export it as jetspec"),
                                               (False, "jetspec", "bidirectional head: export it as dflash")])
def test_head_kind_must_match_the_format(tmp_path, causal, fmt, want):
    target = tiny_model("qwen3")
    src, _, _ = write_release(tmp_path / "src", target.config, causal)
    with pytest.raises(ExportError) as e:
        export_head(src, tmp_path / "out", fmt)
    assert want in one_line(str(e.value))


def test_other_errors_are_one_line(tmp_path):
    target = tiny_model("qwen3")
    src, _, _ = write_release(tmp_path / "src", target.config, True,
                              state_edit=lambda s: s.__setitem__("fc.weight", s["fc.weight"].bfloat16()))
    with pytest.raises(ExportError) as e:
        export_head(src, tmp_path / "out", "jetspec")
    assert "several dtypes (bfloat16, float32)" in one_line(str(e.value))
    src, _, _ = write_release(tmp_path / "src2", target.config, True)
    with pytest.raises(ExportError) as e:
        export_head(src, src, "jetspec")
    assert "the head's own folder" in one_line(str(e.value))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.safetensors").write_bytes(b"")
    with pytest.raises(ExportError) as e:
        export_head(src, tmp_path / "busy", "jetspec")
    assert "other.safetensors" in one_line(str(e.value))
    with pytest.raises(ExportError) as e:
        export_head(src, tmp_path / "out", "eagle")
    assert "unknown release format 'eagle'" in one_line(str(e.value))


# ----------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("causal, dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_release_head_round_trips(tmp_path, causal, dtype):
    """release -> export_head -> the same tensors (names, values, dtype) and dflash_config; and release -> load_head
    -> this project's format (save_head) -> export_head -> the same again."""
    from transformers import AutoConfig

    target = tiny_model("qwen3")
    src, cfg, _ = write_release(tmp_path / "src", target.config, causal,
                                state_edit=lambda s: s.update({k: v.to(dtype) for k, v in s.items()}))
    fmt = "jetspec" if causal else "dflash"
    orig = load_file(str(src / "model.safetensors"))
    via_project = save_head(load_head(src), tmp_path / "project", dtype=dtype)
    for i, source in enumerate([src, via_project]):
        out = export_head(source, tmp_path / f"out{i}", fmt)
        got = load_file(str(out / "model.safetensors"))
        assert sorted(got) == sorted(orig)
        assert all(got[k].dtype == dtype and torch.equal(got[k], orig[k]) for k in orig)
        raw = json.loads((out / "config.json").read_text())
        assert raw["dflash_config"] == cfg["dflash_config"], (raw["dflash_config"], cfg["dflash_config"])
        assert ("causal_head" in raw["dflash_config"]) is causal and raw.get("is_causal", False) is causal
        for key in ("model_type", "block_size", "num_target_layers", "rope_theta", "rms_norm_eps", "head_dim",
                    "num_key_value_heads", "vocab_size", "architectures"):
            assert raw[key] == cfg[key], key
        assert raw["torch_dtype"] == str(dtype).removeprefix("torch.")
        hf = AutoConfig.from_pretrained(out)  # a plain HF config: the dtype a loader takes
        assert hf.model_type == "qwen3" and hf.dtype == dtype


def test_target_fills_what_the_head_lacks_and_is_checked(tmp_path):
    target = tiny_model("qwen3")
    target.save_pretrained(tmp_path / "target")
    src, _, _ = write_release(tmp_path / "src", target.config, True, num_target_layers=None)
    raw = json.loads((export_head(src, tmp_path / "a", "jetspec") / "config.json").read_text())
    assert "num_target_layers" not in raw and "max_position_embeddings" not in raw
    raw = json.loads((export_head(src, tmp_path / "b", "jetspec", tmp_path / "target") / "config.json").read_text())
    assert raw["num_target_layers"] == 2 and raw["max_position_embeddings"] == 512
    nameless, _ = project_head(tmp_path / "nameless", model_type="")
    with pytest.raises(ExportError) as e:
        export_head(nameless, tmp_path / "c", "jetspec")
    assert "model_type" in one_line(str(e.value)) and "--target" in str(e.value)
    out = export_head(nameless, tmp_path / "c", "jetspec", tmp_path / "target")
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "qwen3"
    tiny_model("qwen3", hidden=64).save_pretrained(tmp_path / "wide")
    with pytest.raises(HeadMismatchError) as e:
        export_head(src, tmp_path / "d", "jetspec", tmp_path / "wide")
    assert "hidden_size" in one_line(str(e.value))


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_export_head(tmp_path, capsys):
    target = tiny_model("qwen3")
    src, cfg, _ = write_release(tmp_path / "src", target.config, False)
    assert main(["export-head", str(src), str(tmp_path / "out"), "--format", "dflash"]) == 0
    assert f"-> {tmp_path / 'out'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"] == cfg["dflash_config"]
    for args, want in [([str(DEFAULT_HEAD_DIR), str(tmp_path / "x"), "--format", "jetspec"], "qk_norm is false"),
                       ([str(src), str(tmp_path / "x"), "--format", "jetspec"], "export it as dflash"),
                       ([str(tmp_path / "none"), str(tmp_path / "x"), "--format", "dflash"],
                        "no draft-head checkpoint"),
                       ([str(src), str(tmp_path / "x")], "--format"),
                       ([str(src), str(tmp_path / "x"), "--format", "eagle"], "invalid choice")]:
        code, err = _exit_code(["export-head", *args]), capsys.readouterr().err
        assert code == 2 and want in one_line(err) and err.startswith("jetflow"), (args, err)


def _exit_code(argv) -> int:
    """main()'s return value, or the code of argparse's exit on a usage error."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


# ----------------------------------------------------------------------------------------------- training
def test_release_mask_token_rule():
    from tests.test_train import byte_tokenizer

    tok = byte_tokenizer()  # 258 tokens; pad = eos = <|im_end|> (1); no unk
    assert release_mask_token_id(tok, 300) == (258, "first embedding row past the tokenizer")
    assert release_mask_token_id(tok, 258) == (1, "tokenizer pad_token")
    tok.pad_token, tok.eos_token = None, None
    with pytest.raises(ValueError, match="--mask-token-id"):
        release_mask_token_id(tok, 258)


def test_release_layout_training_exports_the_same_logits(tmp_path, capsys):
    """train_head.py --release-layout on a tiny random Qwen3 (vocab 264 over a 258-token tokenizer), 2 steps, both
    heads; `jetflow export-head` writes them as jetspec / dflash; the project's reader gives the exports the trained
    heads' draft logits within 1e-6 in float32."""
    from tests.scripts import load_script
    from tests.test_train import _records, byte_tokenizer, tiny_target

    model = tiny_target("qwen3", vocab=264)
    model.save_pretrained(tmp_path / "target")
    byte_tokenizer().save_pretrained(tmp_path / "target")
    with open(tmp_path / "regen.jsonl", "w") as f:
        for r in _records(model, n=4, T=24):
            f.write(json.dumps(r) + "\n")
    train_head = load_script("train_head")
    head = tmp_path / "head"
    train_head.main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "regen.jsonl"),
                     "--run", str(tmp_path / "run"), "--steps", "2", "--minutes", "0", "--release-layout",
                     "--taps", "3", "--seqs", "2", "--blocks", "2", "--eval-every", "2", "--eval-frac", "0",
                     "--threads", "1", "--out-causal", str(head), "--out-bidir", str(head) + "-bidir"])
    capsys.readouterr()
    taps = torch.randn(9, 3 * model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    logits = {}
    for trained, fmt in [(head, "jetspec"), (Path(str(head) + "-bidir"), "dflash")]:
        cfg = json.loads((trained / "config.json").read_text())
        assert (cfg["qk_norm"], cfg["draft_vocab_size"], cfg["mask_token_id"]) == (True, 0, 258)
        assert cfg["extra"]["mask_token_rule"] == "first embedding row past the tokenizer"
        assert cfg["extra"]["torch_dtype"] == "bfloat16" and cfg["extra"]["steps"] == 2
        out = tmp_path / f"export-{fmt}"
        assert main(["export-head", str(trained), str(out), "--format", fmt, "--target", str(tmp_path / "target")]) == 0
        raw = json.loads((out / "config.json").read_text())
        assert raw["torch_dtype"] == "bfloat16" and raw["dflash_config"]["mask_token_id"] == 258
        assert raw["model_type"] == "qwen3" and raw["num_target_layers"] == 6
        with torch.no_grad():
            a = loaded_logits(load_head(trained, model, dtype=torch.float32), taps, anchor=7)
            b = loaded_logits(load_head(out, model, dtype=torch.float32), taps, anchor=7)
        assert a.shape == (15, 264) and a.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
        logits[fmt] = a
    assert not torch.allclose(logits["jetspec"], logits["dflash"], atol=1e-3)  # the comparison can tell heads apart
    # a release-layout head has no draft vocabulary
    with pytest.raises(SystemExit):
        train_head.main(["--target", str(tmp_path / "target"), "--data", str(tmp_path / "regen.jsonl"),
                         "--run", str(tmp_path / "run2"), "--release-layout", "--vocab", "128"])
    assert "--vocab 0" in one_line(capsys.readouterr().err.splitlines()[-1])
