"""Tree-mask layouts for the kernels (pure torch, no triton): packing edges, ragged batches, graph padding, the
FlashInfer custom_mask and owned-mask variant layouts checked through CPU emulations of their addressing, the SDPA CPU
path, and the transformers "jetflow_tree" attention (SDPA fallback) inside a tiny Llama."""
import numpy as np
import pytest
import torch

from jetflow_sglang import kernels
from jetflow_sglang.core import tree as core_tree
from experimental import flashinfer_path as fip
from jetflow_sglang.kernels import tree_mask as tm
from jetflow_sglang.kernels.reference import tree_attn_reference, tree_attn_sdpa

torch.set_num_threads(1)


def random_parents(n, g):
    return ([-1] if n else []) + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def ancestors_by_walk(parents):
    """Independent oracle: walk parent pointers into Python int bitsets."""
    rows = []
    for i in range(len(parents)):
        bits, j = 0, i
        while j >= 0:
            bits |= 1 << j
            j = parents[j]
        rows.append(bits)
    return rows


def test_one_source_of_truth():
    assert tm.pack_bits is core_tree.pack_bits and tm.ancestor_mask is core_tree.ancestor_mask
    assert tm.pack_ragged is core_tree.pack_ragged and tm.unpack_bits is core_tree.unpack_bits


def test_package_import_is_light():
    import subprocess
    import sys
    code = "import sys, jetflow_sglang.kernels; assert 'triton' not in sys.modules and 'flashinfer' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("n", [1, 31, 32, 33, 256])
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_packing_edges(n, shape):
    g = torch.Generator().manual_seed(n)
    parents = {"random": random_parents(n, g), "chain": [-1] + list(range(n - 1)),
               "star": [-1] + [0] * (n - 1)}[shape]
    words = tm.pack_bits(tm.ancestor_mask(parents))
    assert words.dtype == torch.int32 and words.shape == (n, -(-n // 32))
    for i, bits in enumerate(ancestors_by_walk(parents)):
        got = sum((int(w) & 0xFFFFFFFF) << (32 * k) for k, w in enumerate(words[i].tolist()))
        assert got == bits, f"row {i}"
    assert torch.equal(tm.unpack_bits(words, n), tm.ancestor_mask(parents))
    if n == 32:  # node 31 on a chain sets the sign bit of its only word
        assert shape != "chain" or words[31, 0] < 0


def test_ragged_batch_rows_and_graph_padding():
    g = torch.Generator().manual_seed(0)
    trees = [random_parents(n, g) for n in (33, 1, 64, 5)]
    words, indptr = tm.pack_ragged(trees)
    assert indptr.tolist() == [0, 33, 34, 98, 103] and words.shape == (103, 2)
    padded = tm.pad_words(words)
    assert padded.shape == (103, tm.GRAPH_WORDS) and torch.equal(padded[:, :2], words) and not padded[:, 2:].any()
    for b, p in enumerate(trees):
        rows = padded[indptr[b]:indptr[b + 1]]
        assert torch.equal(tm.unpack_bits(rows, len(p)), tm.ancestor_mask(p))
    with pytest.raises(ValueError):
        tm.pad_words(torch.zeros(3, 9, dtype=torch.int32))
    with pytest.raises(ValueError):
        tm.pad_words(words.long())


def test_pad_nodes_adds_self_only_rows():
    words = tm.pack_bits(tm.ancestor_mask([-1, 0, 1]), 8)
    padded = tm.pad_nodes(words, 3, 16)
    dense = tm.unpack_bits(padded, 16)
    assert torch.equal(dense[:3, :3], tm.ancestor_mask([-1, 0, 1])) and not dense[:3, 3:].any()
    assert torch.equal(dense[3:, 3:], torch.eye(13, dtype=torch.bool)) and not dense[3:, :3].any()
    with pytest.raises(ValueError):
        tm.pad_nodes(words, 3, 257)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ns, ps = [33, 1, 40], [7, 0, 65]
    trees = [random_parents(n, g) for n in ns]
    words, indptr = tm.pack_ragged(trees)
    return trees, words, indptr, ps


def _expected_allow(parents, p, qo, kv):
    return kv < p or bool(tm.ancestor_mask(parents)[qo, kv - p])


def test_flashinfer_custom_mask_layout_by_emulation():
    """Bool flat mask -> segment packbits (little) -> FlashInfer's ptr[off/8] >> off%8 & 1 addressing."""
    trees, words, indptr, ps = _batch()
    flat = fip.flashinfer_custom_mask(words, indptr, ps)
    bit_indptr = fip.flashinfer_mask_indptr(indptr, ps)
    assert flat.numel() == int(bit_indptr[-1]) == sum(len(t) * (p + len(t)) for t, p in zip(trees, ps))
    packed, byte_indptr = fip.packbits_little(flat, bit_indptr)
    for b, (parents, p) in enumerate(zip(trees, ps)):
        n, kv_len = len(parents), p + len(parents)
        for qo in range(n):
            for kv in range(kv_len):
                want = _expected_allow(parents, p, qo, kv)
                assert fip.flashinfer_mask_bit(packed, byte_indptr, b, qo, kv, kv_len) == want, (b, qo, kv)
    # Big-endian bytes (flashinfer.packbits' default) put bits in the wrong place: the emulation must notice.
    big = torch.from_numpy(np.packbits(flat[:int(bit_indptr[1])].numpy(), bitorder="big"))
    n0, kv0 = len(trees[0]), ps[0] + len(trees[0])
    assert any(fip.flashinfer_mask_bit(big, byte_indptr, 0, q, k, kv0) != _expected_allow(trees[0], ps[0], q, k)
               for q in range(n0) for k in range(kv0))


def test_flashinfer_variant_addressing_by_emulation():
    trees, words, indptr, ps = _batch(1)
    words = tm.pad_words(words)  # the variant reads any word count (tree_words scalar)
    for b, (parents, p) in enumerate(zip(trees, ps)):
        n, kv_len = len(parents), p + len(parents)
        for qo in range(n + 3):  # lanes past qo_len are clamped, never read out of the request's rows
            for kv in range(kv_len):
                want = _expected_allow(parents, p, min(qo, n - 1), kv)
                assert fip.emulate_variant_mask(words, indptr, b, qo, kv, kv_len) == want


def test_flashinfer_variant_source_and_args():
    args = fip.tree_variant_jit_args(torch.bfloat16, 128)
    assert len(args) == 13 and args[11] == fip.VARIANT_NAME and args[12] is fip.TREE_VARIANT_DECL
    assert f"struct {fip.VARIANT_NAME}" in fip.TREE_VARIANT_DECL
    for name in args[7] + args[9]:  # every declared tensor/scalar is what the variant reads as params.<name>
        assert f"params.{name}" in fip.TREE_VARIANT_DECL
    assert "window_left = kv_len" in fip.TREE_VARIANT_DECL  # no sliding-window tile pruning


def test_stock_plan_args_sglang_layout():
    trees, words, indptr, ps = _batch(2)
    kv_lens = [p + len(t) for t, p in zip(trees, ps)]
    table = torch.arange(3 * 128, dtype=torch.int32).view(3, 128)
    a = fip.stock_plan_args(table, torch.tensor(ps, dtype=torch.int32), indptr, words, page_size=1)
    assert a["paged_kv_indptr"].tolist() == [0] + np.cumsum(kv_lens).tolist()
    assert a["paged_kv_last_page_len"].tolist() == [1, 1, 1]
    assert torch.equal(a["custom_mask"], fip.flashinfer_custom_mask(words, indptr, ps))
    a16 = fip.paged_kv_args(table, kv_lens, 16)
    assert a16["paged_kv_last_page_len"].tolist() == [(k - 1) % 16 + 1 for k in kv_lens]
    with pytest.raises(ValueError):
        fip.paged_kv_args(table[:, :1], kv_lens, 1)


def test_flashinfer_absent_or_consistent():
    if not fip.available():
        with pytest.raises(ImportError, match="flashinfer-python"):
            fip.flashinfer()
        pytest.skip("flashinfer is not installed (optional, GPU only)")
    from flashinfer.prefill import _compute_page_mask_indptr
    trees, words, indptr, ps = _batch()
    kv_lens = torch.tensor([p + len(t) for t, p in zip(trees, ps)], dtype=torch.int32)
    want = fip.flashinfer_mask_indptr(indptr, ps)
    assert _compute_page_mask_indptr(indptr, torch.tensor([0, *kv_lens.cumsum(0).tolist()]), torch.ones_like(kv_lens),
                                     1).tolist() == want.tolist()


def _paged(ns, ps, hq, hkv, d, page, seed):
    g = torch.Generator().manual_seed(seed)
    words, indptr = tm.pack_ragged([random_parents(n, g) for n in ns])
    pages = [-(-(p + n) // page) for n, p in zip(ns, ps)]
    table = torch.randperm(sum(pages), generator=g).to(torch.int32)
    table = torch.nn.utils.rnn.pad_sequence(list(table.split(pages)), batch_first=True)
    k, v = torch.randn(2, sum(pages), page, hkv, d, generator=g)
    return torch.randn(sum(ns), hq, d, generator=g), k, v, table, torch.tensor(ps, dtype=torch.int32), indptr, words


@pytest.mark.parametrize("page", [1, 16])
def test_sdpa_cpu_path_matches_reference(page):
    args = _paged([33, 1, 20], [50, 0, 17], 8, 2, 32, page, page)
    ref = tree_attn_reference(*args)
    out = tree_attn_sdpa(*args)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-6


# ---- transformers wiring (CPU: SDPA fallback) ---------------------------------------------------------------------

def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("n", [1, 40])
def test_hf_jetflow_tree_attention_matches_float_mask(n):
    import jetflow_sglang.kernels.hf_tree_attention as hta
    from transformers import DynamicCache

    model = _tiny_llama()
    g = torch.Generator().manual_seed(n)
    prefix = torch.randint(0, 97, (1, 11), generator=g)
    parents = random_parents(n, g)
    tree = core_tree.DraftTree(tokens=torch.randint(0, 97, (n,), generator=g).tolist(), parents=parents,
                               depths=[0] * n, logps=[0.0] * n)
    for i in range(1, n):
        tree.depths[i] = tree.depths[parents[i]] + 1
    ids = torch.tensor([tree.tokens])
    pos = 11 + torch.tensor([tree.depths])
    p = prefix.shape[1]

    def run(impl, mask, ctx):
        model.config._attn_implementation = impl
        cache = DynamicCache(config=model.config)
        pre = model(input_ids=prefix, past_key_values=cache, use_cache=True).logits
        if ctx:
            with hta.tree_mask_context(tree.packed_mask(), p):
                out = model(input_ids=ids, position_ids=pos, past_key_values=cache, attention_mask=mask).logits
        else:
            out = model(input_ids=ids, position_ids=pos, past_key_values=cache, attention_mask=mask).logits
        return pre, out

    with torch.no_grad():
        allow = torch.ones(n, p + n, dtype=torch.bool)
        allow[:, p:] = tree.ancestor_mask()
        additive = torch.zeros(allow.shape).masked_fill(~allow, torch.finfo(torch.float32).min)[None, None]
        pre_ref, ref = run("eager", additive, False)
        pre_jt, got = run(hta.NAME, None, True)
    torch.testing.assert_close(pre_jt, pre_ref, rtol=1e-5, atol=1e-5)  # outside the context: plain causal SDPA
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if n > 1:  # the mask matters: plain causal over the tree rows gives different logits
        with torch.no_grad():
            _, causal = run(hta.NAME, None, False)
        assert not torch.allclose(causal, ref, atol=1e-3)


def test_hf_context_rejects_wrong_prefix():
    import jetflow_sglang.kernels.hf_tree_attention as hta
    from transformers import DynamicCache

    model = _tiny_llama()
    model.config._attn_implementation = hta.NAME
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
        with hta.tree_mask_context(core_tree.chain(5, [6]).packed_mask(), 2), pytest.raises(ValueError, match="prefix"):
            model(input_ids=torch.tensor([[5, 6]]), past_key_values=cache)
    with pytest.raises(ValueError, match="int32"):
        with hta.tree_mask_context(torch.zeros(2, 1), 0):
            pass


def test_package_exports():
    assert kernels.GRAPH_WORDS == 8 and kernels.pad_words is tm.pad_words
