"""Training pipeline: losses, regeneration, teacher features, a tiny end-to-end run, and the exported head drafting."""
import json

import pytest
import torch

from jetflow_sglang.train import data as D
from jetflow_sglang.train import losses as L

torch.set_num_threads(1)

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer():
    """A real HF fast tokenizer (byte-level, no merges) with a chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|im_start|>": 0, "<|im_end|>": 1, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", chat_template=CHAT)


def tiny_target(arch="llama", vocab=258, seed=0):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=0,
              eos_token_id=1, pad_token_id=1, initializer_range=0.2)  # peaky logits: a teacher worth copying
    if arch == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    elif arch == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**kw))
    else:
        m = LlamaForCausalLM(LlamaConfig(**kw))
    return m.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------- losses
def test_losses_gradient_signs():
    """Teacher puts most mass on token 0; the student puts most on token 2. Every loss must push logit 0 up and
    logit 2 down (negative / positive gradient), and each is zero-gradient at its optimum."""
    p = torch.tensor([[0.7, 0.2, 0.1]]).log()
    z = torch.tensor([[0.0, 0.0, 2.0]], requires_grad=True)
    for kind in L.LOSSES:
        z.grad = None
        L.slot_loss(kind, z, p, torch.tensor([0])).sum().backward()
        g = z.grad[0]
        assert g[0] < 0 < g[2], (kind, g)
        assert abs(float(g.sum())) < 1e-5  # softmax gradients sum to zero
    # closed forms: forward KL grad = q - p, SFT grad = q - onehot
    q = z.detach().softmax(-1)
    z.grad = None
    L.forward_kl(z, p).sum().backward()
    torch.testing.assert_close(z.grad, q - p.exp())
    # optimum: student == teacher gives zero forward/reverse KL and zero gradient
    z2 = p.clone().requires_grad_(True)
    for fn in (L.forward_kl, L.reverse_kl):
        z2.grad = None
        v = fn(z2, p).sum()
        v.backward()
        assert abs(v.item()) < 1e-6 and z2.grad.abs().max() < 1e-6
    with pytest.raises(ValueError):
        L.slot_loss("nope", z, p, torch.tensor([0]))


def test_reverse_kl_is_mode_seeking():
    """Bimodal teacher, student centred on one mode vs smeared: reverse KL prefers the mode, forward KL the smear."""
    p = torch.tensor([[0.49, 0.02, 0.49]]).log()
    mode = torch.tensor([[5.0, 0.0, 0.0]])
    smear = torch.tensor([[1.0, 1.0, 1.0]])
    assert L.reverse_kl(mode, p) < L.reverse_kl(smear, p) + 0.5
    assert L.forward_kl(smear, p) < L.forward_kl(mode, p)


def test_depth_weights():
    d = torch.tensor([1, 2, 8])
    assert torch.equal(L.depth_weights(d, 0.0), torch.ones(3))
    w = L.depth_weights(d, 4.0)
    assert w[0] == 1 and w[0] > w[1] > w[2]


# ----------------------------------------------------------------------------------------------- data
def test_sharegpt_truncated_json_is_recovered():
    full = json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)])
    cut = full[:full.index('"3"') + 5]  # torn inside record 3
    got = list(D.iter_sharegpt_json(cut))
    assert [g["id"] for g in got] == ["0", "1", "2"]
    assert [g["id"] for g in D.iter_sharegpt_json(full)] == ["0", "1", "2", "3", "4"]


def test_stdlib_code_prompts_and_decontamination():
    code = D.load_stdlib_code()
    assert len(code) > 1000 and all("def " in c for c in code[:50])
    ev = "Natalia sold clips to 48 of her friends in April and then she sold half as many clips in May today"
    grams = D._ngrams(ev)
    kept = D.decontaminate(["Natalia sold clips to 48 of her friends in April and then she sold half as many clips "
                            "in May today, how many?", "an unrelated prompt"], grams)
    assert kept == ["an unrelated prompt"]


def test_shipped_gsm8k_prompts_are_train_only():
    qs = D.load_gsm8k_train()
    assert len(qs) == 7473
    assert (D.DATA_DIR / "LICENSE-gsm8k.txt").exists()


def test_regenerated_sample_decodes_to_greedy_text(tmp_path):
    tok, model = byte_tokenizer(), tiny_target()
    prompts = {"gsm8k": ["What is 2+2?", "A much longer prompt, so that the batch needs left padding."],
               "code": ["def f(x):"]}
    recs = D.regenerate(model, tok, prompts, tmp_path / "r.jsonl", target_tokens=10_000, mix={"gsm8k": .5, "code": .5},
                        sample_frac=0.0, batch_size=4, max_new_tokens=12, progress=False)
    assert len(recs) == 3 and all(r["mode"] == "greedy" for r in recs)
    for r in recs:
        src, i = r["key"].split("/")
        ids = D.chat_ids(tok, prompts[src][int(i)])
        assert r["ids"][:r["prompt_len"]] == ids
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, pad_token_id=1, eos_token_id=1)[0, len(ids):]
        assert tok.decode(r["ids"][r["prompt_len"]:]) == tok.decode(ref.tolist())
    # resumable: a rerun finds everything done and adds nothing
    again = D.regenerate(model, tok, prompts, tmp_path / "r.jsonl", target_tokens=10_000, mix={"gsm8k": .5, "code": .5},
                         sample_frac=0.0, batch_size=4, max_new_tokens=12, progress=False)
    assert len(again) == 3 and len(D.read_records(tmp_path / "r.jsonl")) == 3


# ----------------------------------------------------------------------------------------------- features + training
def _records(model, n=12, T=60, seed=0):
    """Target-written sequences (greedy from random prompts), like regenerate() produces."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        p = torch.randint(2, model.config.vocab_size, (8,), generator=g)
        out = model.generate(p[None], attention_mask=torch.ones(1, 8, dtype=torch.long), do_sample=False,
                             max_new_tokens=T, min_new_tokens=T, pad_token_id=1)
        recs.append({"key": f"t/{i}", "source": "t", "mode": "greedy", "prompt_len": 8, "ids": out[0].tolist()})
    return recs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_features_match_target(arch, tmp_path):
    from jetflow_sglang.train.features import build_cache

    model = tiny_target(arch)
    recs = _records(model, n=3, T=10)
    recs[1]["ids"] = recs[1]["ids"][:-4]  # unequal lengths: exercises right padding
    items = build_cache(model, recs, [1, 3], tmp_path / "c", progress=False)
    for r, it in zip(recs, items):
        out = model(torch.tensor([r["ids"]]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[2][0], out.hidden_states[4][0]], -1)
        torch.testing.assert_close(it["taps"].float(), taps, atol=2e-2, rtol=2e-2)
        logits = it["final"].float() @ model.get_output_embeddings().weight.T
        torch.testing.assert_close(logits, out.logits[0], atol=5e-2, rtol=2e-2)
    again = build_cache(model, recs, [1, 3], tmp_path / "c", progress=False)  # resumes from the shards
    assert [a["key"] for a in again] == [r["key"] for r in recs]
    with pytest.raises(ValueError, match="feature cache"):
        build_cache(model, recs, [2, 3], tmp_path / "c", progress=False)


def test_block_mask_and_branch_slots():
    import random

    from jetflow_sglang.head import MASK
    from jetflow_sglang.train.trainer import head_inputs, sample_batch

    T, bs = 40, 4
    item = {"ids": torch.arange(T), "prompt_len": 10, "taps": torch.zeros(T, 8), "final": torch.zeros(T, 4)}
    b = sample_batch([item], random.Random(0), 1, 3, bs, branch_prob=1.0)
    tokens, pos, mask, scored = head_inputs(b, causal=True, branch=True)
    a, k = b["anchors"][0], b["k"][0]
    for blk in range(3):
        row = slice(blk * bs, (blk + 1) * bs)
        assert pos[0, row].tolist() == list(range(a[blk], a[blk] + bs))
        toks = tokens[0, row].tolist()
        assert toks[0] == a[blk] and toks[1:k[blk] + 1] == list(range(a[blk] + 1, a[blk] + k[blk] + 1))
        assert all(t == MASK for t in toks[k[blk] + 1:])
        assert scored[0, blk].tolist() == [bool(j > k[blk] and a[blk] + j < T) for j in range(bs)]
        m = mask[0, blk * bs]
        assert m[:T].sum() == a[blk] and m[:a[blk]].all()  # context rows strictly before the anchor
        assert m[T:].sum() == 1  # causal: slot 0 sees only itself, no other block
        assert mask[0, blk * bs + bs - 1, T:].sum() == bs
    _, _, mb, _ = head_inputs(b, causal=False, branch=False)
    assert mb[0, 0, T:].sum() == bs  # bidirectional: the whole own block, nothing else


def test_tiny_training_lowers_loss_and_head_drafts(tmp_path):
    from jetflow_sglang.draft.drafters import make_drafter
    from jetflow_sglang.head import load_head
    from jetflow_sglang.engine.target import Target
    from jetflow_sglang.train.features import build_cache
    from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, export, make_head, train

    model = tiny_target()
    items = build_cache(model, _records(model, n=10, T=48), [1, 3, 4], tmp_path / "c", progress=False)
    vocab = draft_vocab(items, 128, model.config.vocab_size)
    assert len(vocab) == 128 and torch.equal(vocab, vocab.sort().values)
    heads = {"causal": make_head(model, True, vocab, num_layers=2, n_taps=3),
             "bidir": make_head(model, False, vocab, num_layers=2, n_taps=3)}
    assert heads["causal"].config.tap_layers == [1, 2, 3]  # default rule for 6 layers, 3 taps
    cfg = TrainConfig(lr=3e-3, warmup=2, steps=40, seqs=2, blocks=4, eval_every=40, ckpt_every=20, log_every=5)
    hist = train(heads, model, items[:8], items[8:], cfg, tmp_path / "run", progress=False)
    log = [json.loads(x) for x in open(tmp_path / "run" / "log.jsonl") if '"loss"' in x]
    for n in heads:
        curve = [r["loss"] for r in log if r["head"] == n]
        assert len(curve) == 8 and curve[-1] < 0.8 * curve[0], (n, curve)
        assert hist[n][-1]["tau_w8"] >= 1.0
    # resuming a finished run is a no-op that keeps the step count
    cfg2 = TrainConfig(**{**cfg.__dict__, "steps": 40})
    train(heads, model, items[:8], items[8:], cfg2, tmp_path / "run", progress=False)
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["step"] == 40

    out = export(heads["causal"], tmp_path / "head", {"steps": 40})
    target = Target(model, byte_tokenizer(), tap_layers=heads["causal"].config.tap_layers)
    head = load_head(out, target)
    assert head.config.draft_vocab_size == 128 and torch.equal(head.vocab_ids, vocab)
    assert head.config.extra["steps"] == 40
    for name in ("jetflow", "jetflow-branch"):
        drafter = make_drafter(name, head)
        prompt = items[9]["ids"][:20].tolist()
        _, taps = target.prefill(prompt)
        state = drafter.new_state(prompt, taps)
        tree = drafter.draft(state, anchor=int(items[9]["ids"][20]), budget=16)
        assert 1 < len(tree) <= 16
        assert set(tree.tokens[1:]) <= set(vocab.tolist())  # drafts only from the reduced vocabulary


@pytest.mark.parametrize("causal", [True, False])
def test_training_forward_matches_the_drafter(causal, tmp_path):
    """The packed multi-block training forward must give exactly what the drafter computes at inference for the same
    anchor: the plain block (block_logprobs) and, for the causal head, the branch-conditioned pass."""
    import random

    from jetflow_sglang.draft.drafters import make_drafter
    from jetflow_sglang.train.features import build_cache
    from jetflow_sglang.train.trainer import draft_vocab, head_inputs, make_head, sample_batch
    from jetflow_sglang.core.tree import DraftTree

    model = tiny_target().float()
    items = build_cache(model, _records(model, n=2, T=40), [1, 3], tmp_path / "c", progress=False)
    vocab = draft_vocab(items, 96, model.config.vocab_size)
    head = make_head(model, causal, vocab, num_layers=2, n_taps=2).eval()
    lm_w = model.get_output_embeddings().weight[vocab]
    b = sample_batch(items[:1], random.Random(3), 1, 3, 16, branch_prob=1.0 if causal else 0.0)
    item = items[0]
    for branch in ([False, True] if causal else [False]):
        tokens, pos, mask, _ = head_inputs(b, causal, branch)
        T = b["ids"].shape[1]
        with torch.no_grad():
            kv = head.context_kv(b["taps"].float(), torch.arange(T)[None])
            hid = head(tokens, pos, kv, mask).view(1, 3, 16, -1)
        drafter = make_drafter("jetflow" if causal else "ddtree", head)
        for blk in range(3):
            a, k = int(b["anchors"][0, blk]), int(b["k"][0, blk]) if branch else 0
            train_lp = (hid[0, blk] @ lm_w.T).log_softmax(-1)
            ids = item["ids"].tolist()
            state = drafter.new_state(ids[:a], item["taps"][:a].float())  # the cached (bf16) taps the trainer saw
            if not branch:
                torch.testing.assert_close(drafter.block_logprobs(state, ids[a]), train_lp[1:], atol=1e-4, rtol=1e-4)
            else:  # a chain anchor -> y1..yk; the MASK query after node k is the training slot k+1
                chain = DraftTree([ids[a]], [-1], [0], [0.0])
                for d in range(1, k + 1):
                    chain.add(ids[a + d], d - 1, 0.0)
                lp = drafter.conditioned_logprobs(state, chain)
                torch.testing.assert_close(lp[k], train_lp[k + 1], atol=1e-4, rtol=1e-4)


def test_frozen_prompts_round_trip(tmp_path):
    """--save-prompts / --prompts: a machine without the prompt sources gets the same prompts, in the same order."""
    prompts = {"gsm8k": ["What is 2 + 2?", "Tom has 3 apples."], "code": ["def f(x):\n    '''Double x.'''"]}
    D.save_prompts(prompts, tmp_path / "p.json.gz")
    assert D.read_prompts(tmp_path / "p.json.gz") == prompts
    bad = tmp_path / "bad.json.gz"
    import gzip
    with gzip.open(bad, "wt") as f:
        f.write('["not", "a", "dict"]')
    with pytest.raises(ValueError, match="expected"):
        D.read_prompts(bad)
