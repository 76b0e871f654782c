"""Released head formats load directly: tiny checkpoints written here in the DFlash release layout (bidirectional) and
the JetFlow release layout (the same with dflash_config.causal_head), checked against a reference forward written
below from the published architecture, with transformers' own Qwen3 rotary helpers."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from jetflow_sglang.draft.fit import drafter_for
from jetflow_sglang.head import MASK, CheckpointError, HeadMismatchError, load_head, read_head_config
from tests.helpers import tiny_model

torch.set_num_threads(1)

D_LAYERS, HEADS, KV, HEAD_DIM, INTER, THETA, EPS = 2, 4, 2, 8, 48, 1_000_000.0, 1e-6


def release_config(target_cfg, causal: bool, taps=(0, 1), block_size=8, mask_token_id=None, **top) -> dict:
    """A config.json as the DFlash (causal=False) and JetFlow (causal=True) releases write it."""
    dcfg = {"target_layer_ids": list(taps),
            "mask_token_id": target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id}
    if causal:
        dcfg["causal_head"] = True
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target_cfg.hidden_size,
           "intermediate_size": INTER, "num_hidden_layers": D_LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": HEAD_DIM, "vocab_size": target_cfg.vocab_size,
           "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512, "attention_bias": False,
           "hidden_act": "silu", "tie_word_embeddings": False, "block_size": block_size,
           "num_target_layers": target_cfg.num_hidden_layers, "dflash_config": dcfg}
    cfg.update(top)
    return cfg


def release_weights(cfg: dict, seed: int = 3, prefix: str = "") -> dict:
    g = torch.Generator().manual_seed(seed)
    d, n_taps = cfg["hidden_size"], len(cfg["dflash_config"]["target_layer_ids"])

    def w(*shape, scale=0.2):
        return (scale * torch.randn(*shape, generator=g)).contiguous()

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).contiguous()

    state = {f"{prefix}fc.weight": w(d, n_taps * d, scale=0.1), f"{prefix}hidden_norm.weight": norm(d),
             f"{prefix}norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        state.update({
            p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, d), p + "self_attn.k_proj.weight": w(KV * HEAD_DIM, d),
            p + "self_attn.v_proj.weight": w(KV * HEAD_DIM, d), p + "self_attn.o_proj.weight": w(d, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM), p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, d), p + "mlp.up_proj.weight": w(INTER, d),
            p + "mlp.down_proj.weight": w(d, INTER),
        })
    return state


def write_release(out, target_cfg, causal: bool, prefix: str = "", state_edit=None, **cfg_kw):
    out.mkdir(parents=True, exist_ok=True)
    cfg = release_config(target_cfg, causal, **cfg_kw)
    state = release_weights(cfg, prefix=prefix)
    if state_edit:
        state_edit(state)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out / "model.safetensors"))
    return out, cfg, state


# -- independent reference: the published DFlash/JetSpec draft-head forward -------------------------------------------
def rms(x, w, eps=EPS):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(cfg: dict, state: dict, target, taps: torch.Tensor, anchor: int, causal: bool) -> torch.Tensor:
    """Draft logits [block-1, V] for depths 1..block-1.

    noise = target.embed([anchor, mask_token_id x (block-1)]); c = hidden_norm(fc(taps)) is the context; every layer
    projects c with its own k/v projections and prepends it to the block's keys/values (context K/V injection);
    positions are absolute (context 0..T-1, block T..T+block-1); queries are the block slots only; in-block attention
    is causal for the JetFlow release and bidirectional for DFlash; logits = target.lm_head(norm(h)).
    """
    s = {k.removeprefix("model."): v for k, v in state.items()}
    T, B = taps.shape[0], cfg["block_size"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    emb = target.get_input_embeddings().weight
    h = emb[torch.tensor([anchor] + [mask_id] * (B - 1))]
    c = rms(taps @ s["fc.weight"].T, s["hidden_norm.weight"])
    hf_cfg = Qwen3Config(hidden_size=cfg["hidden_size"], num_attention_heads=HEADS, num_key_value_heads=KV,
                         head_dim=HEAD_DIM, rope_theta=THETA, max_position_embeddings=512)
    rope = Qwen3RotaryEmbedding(hf_cfg)
    pos = torch.arange(T + B)[None]
    cos, sin = rope(h[None], pos)
    allow = torch.ones(B, T + B, dtype=torch.bool)
    if causal:
        allow[:, T:] = torch.ones(B, B, dtype=torch.bool).tril()
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, s[p + "input_layernorm.weight"])
        q = (x @ s[p + "self_attn.q_proj.weight"].T).view(B, HEADS, HEAD_DIM)
        k = torch.cat([c, x]) @ s[p + "self_attn.k_proj.weight"].T
        v = torch.cat([c, x]) @ s[p + "self_attn.v_proj.weight"].T
        q = rms(q, s[p + "self_attn.q_norm.weight"]).transpose(0, 1)[None]  # [1, H, B, hd]
        k = rms(k.view(T + B, KV, HEAD_DIM), s[p + "self_attn.k_norm.weight"]).transpose(0, 1)[None]
        v = v.view(T + B, KV, HEAD_DIM).transpose(0, 1)[None]
        # rotate the queries at their own (block) positions, keys at all positions
        q, _ = apply_rotary_pos_emb(q, q, cos[:, T:], sin[:, T:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
        att = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        att = att.masked_fill(~allow, float("-inf")).softmax(-1)
        o = (att @ v)[0].transpose(0, 1).reshape(B, HEADS * HEAD_DIM)
        h = h + o @ s[p + "self_attn.o_proj.weight"].T
        x = rms(h, s[p + "post_attention_layernorm.weight"])
        gate, up = x @ s[p + "mlp.gate_proj.weight"].T, x @ s[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ s[p + "mlp.down_proj.weight"].T
    h = rms(h, s["norm.weight"])
    return (h @ target.get_output_embeddings().weight.T)[1:]


def loaded_logits(head, taps: torch.Tensor, anchor: int) -> torch.Tensor:
    T, B = taps.shape[0], head.config.block_size
    kv = head.context_kv(taps[None], torch.arange(T)[None])
    tokens = torch.tensor([[anchor] + [MASK] * (B - 1)])
    hidden = head(tokens, torch.arange(T, T + B)[None], kv, head.block_mask(T, B)[None])
    return head.logits(hidden)[0, 1:]


@pytest.mark.parametrize("causal, prefix", [(True, ""), (False, ""), (True, "model.")])
def test_release_logits_equal_reference(tmp_path, causal, prefix):
    target = tiny_model("qwen3")  # hidden 32, 2 layers, vocab 64
    out, cfg, state = write_release(tmp_path / "head", target.config, causal, prefix=prefix)
    head = load_head(out, target)
    assert head.config.causal is causal and head.config.mask_token_id == target.config.vocab_size - 1
    assert drafter_for(head.config) == ("jetflow" if causal else "ddtree")
    taps = torch.randn(7, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, ref = loaded_logits(head, taps, anchor=11), reference_logits(cfg, state, target, taps, 11, causal)
    assert ours.shape == ref.shape == (cfg["block_size"] - 1, target.config.vocab_size)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # the reference itself can tell the two head kinds apart (the check is not vacuous)
    other = reference_logits(cfg, state, target, taps, 11, not causal)
    assert not torch.allclose(other, ref, atol=1e-3)


def test_release_config_fields_map(tmp_path):
    target = tiny_model("qwen3")
    out, cfg, _ = write_release(tmp_path / "head", target.config, causal=True, taps=(1, 0), block_size=5)
    head_cfg, fmt = read_head_config(out)
    assert fmt == "dflash"
    assert (head_cfg.tap_layers, head_cfg.block_size, head_cfg.rope_theta, head_cfg.num_layers, head_cfg.head_dim,
            head_cfg.intermediate_size, head_cfg.qk_norm) == ([1, 0], 5, THETA, D_LAYERS, HEAD_DIM, INTER, True)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def _drop(key):
    return lambda s: s.pop(key)


def _reshape(key):
    return lambda s: s.__setitem__(key, torch.zeros(3, 5))


@pytest.mark.parametrize("kw, field", [
    (dict(taps=(-1, 1)), "target_layer_ids[0]=-1"),
    (dict(taps=(0, 2)), "target_layer_ids[1]=2"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=1), "block_size"),
    (dict(mask_token_id=64), "mask_token_id"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(state_edit=_drop("layers.1.mlp.up_proj.weight")), "layers.1.up_proj.weight"),
    (dict(state_edit=_reshape("fc.weight")), "fc.weight"),
    (dict(state_edit=lambda s: s.__setitem__("lm_head.weight", torch.zeros(2, 2))), "lm_head.weight"),
])
def test_release_format_errors_name_the_field(tmp_path, kw, field):
    target = tiny_model("qwen3")
    state_edit = kw.pop("state_edit", None)
    out, _, _ = write_release(tmp_path / "head", target.config, causal=True, state_edit=state_edit, **kw)
    with pytest.raises((CheckpointError, HeadMismatchError)) as e:
        load_head(out, target)
    assert field in _one_line(e)


def test_release_errors_for_config_and_target(tmp_path):
    target = tiny_model("qwen3")
    out, cfg, _ = write_release(tmp_path / "head", target.config, causal=False)
    with pytest.raises(HeadMismatchError) as e:  # a head for a wider target
        load_head(out, tiny_model("qwen3", hidden=64))
    assert "hidden_size" in _one_line(e)
    with pytest.raises(HeadMismatchError) as e:
        load_head(out, tiny_model("qwen3", vocab=80))
    assert "vocab_size" in _one_line(e)
    for bad, field in [({**cfg, "dflash_config": {**cfg["dflash_config"], "causal_head": "yes"}}, "causal_head"),
                       ({k: v for k, v in cfg.items() if k != "hidden_size"}, "hidden_size"),
                       ({**cfg, "dflash_config": {"target_layer_ids": [0, 1]}}, "mask_token_id"),
                       ([cfg], "expected a JSON object"),
                       ({"model_type": "llama", "hidden_size": 32}, "not a draft-head config")]:
        (out / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError) as e:
            load_head(out, target)
        assert field in _one_line(e), bad


def test_head_kind_must_fit_the_drafter(tmp_path):
    target = tiny_model("qwen3")
    causal, _, _ = write_release(tmp_path / "causal", target.config, causal=True)
    bidir, _, _ = write_release(tmp_path / "bidir", target.config, causal=False)
    c, b = read_head_config(causal)[0], read_head_config(bidir)[0]
    assert drafter_for(c, "jetflow-branch") == "jetflow-branch" and drafter_for(b, "dflash") == "dflash"
    for cfg, name in [(c, "ddtree"), (c, "dflash"), (b, "jetflow"), (b, "jetflow-branch")]:
        with pytest.raises(HeadMismatchError) as e:
            drafter_for(cfg, name)
        assert name in _one_line(e)


def test_repo_id_resolves_through_the_hub_cache(tmp_path, monkeypatch):
    """`--head z-lab/...` / --speculative-draft-model-path with a repo id: the hub's local snapshot is read, and
    nothing is downloaded (local_files_only, whatever HF_HUB_OFFLINE says)."""
    import huggingface_hub

    target = tiny_model("qwen3")
    out, _, _ = write_release(tmp_path / "snapshot", target.config, causal=False)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: asked.append((repo, kw.get("local_files_only")))
                        or str(out))
    head = load_head("z-lab/Tiny-DFlash-b8", target)
    assert asked == [("z-lab/Tiny-DFlash-b8", True)] and head.config.causal is False

    def offline(repo, **kw):
        raise OSError("Cannot find an appropriate cached snapshot folder\nfor the specified revision")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError) as e:
        load_head("z-lab/Missing-DFlash", target)
    assert "z-lab/Missing-DFlash is not a local folder and is not in the local Hugging Face hub cache" in _one_line(e)


def test_release_head_through_the_server_target_view(tmp_path):
    """The SGLang worker loads heads through load_head with a TargetView (embedding forward + LM head weight): a
    released head loaded that way gives the reference logits too."""
    from jetflow_sglang.sglang.target_view import TargetView

    target = tiny_model("qwen3")
    out, cfg, state = write_release(tmp_path / "head", target.config, causal=True)
    head = load_head(out, TargetView(target, target.config))
    taps = torch.randn(5, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded_logits(head, taps, 3), reference_logits(cfg, state, target, taps, 3, True),
                                   rtol=1e-4, atol=1e-4)
