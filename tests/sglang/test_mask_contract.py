"""The tree-mask contract with SGLang's own GPU attention backends (issue #30, item 3), checked on the CPU.

JETFLOW verifies through SGLang's NGRAM_VERIFY layout: a fixed `n` tree rows per request and a FULL bool custom mask
(per request an [n, L + n] block, prefix columns True, requests concatenated). Two consumers of that mask are
reproduced here exactly as SGLang 0.5.23 drives them in TARGET_VERIFY, and each must give what `jetflow_tree_native`
(TreeTorchNativeAttnBackend.forward_extend, SDPA with window_mask) gives, and what the float64 oracle
(kernels.reference.tree_attn_reference, built from the parents alone) gives:

- SGLang's triton backend: `extend_attention_fwd` (sglang.kernels.ops.attention.extend_attention) under the Triton
  interpreter, with the arguments TritonAttnBackend.init_forward_metadata / forward_extend build for target verify:
  qo_indptr = arange(b + 1) * n (int32), kv_indptr = cumsum(seq_lens) and kv_indices = the committed prefix only
  (SGLang's KVIndexTranslator.pack_read_stream over req_to_token, i.e. create_flashinfer_kv_indices_triton), the
  n draft rows' K/V passed as k_extend/v_extend (also written at out_cache_loc = req_to_token[r, L:L + n]),
  custom_mask = spec_info.custom_mask, is_causal=True (ignored by the kernel when a custom mask is given),
  mask_indptr = cumsum(n * (seq_lens + n)) (int64), max_len_extend = n, skip_prefix_custom_mask left at True
  (prefix columns of the mask are never read), page_size = the pool's.
- SGLang's flashinfer backend: NgramVerifyInput.generate_attn_arg_prefill (SGLang's code, through a real, plain
  KVIndexTranslator): kv_indptr over L + n and kv_indices that include the draft slots, the custom mask passed on
  unpadded; FlashInfer's plan(page_size=1) then sets mask_indptr = cumsum(qo_len * kv_len) and packs each segment with
  segment_packbits(bitorder="little"); its kernel reads bit qo * kv_len + kv of the segment. Emulated on the CPU with
  experimental.flashinfer_path.packbits_little / flashinfer_mask_bit: every bit must equal window_mask, and attention over the
  slots kv_indices names, masked by those bits, must equal jetflow_tree_native.

Cases: random trees with ragged sizes inside the fixed n (padding slots as TreeBatch makes them), ragged prefix
lengths, req_pool_indices out of order, and KV slots allocated in pages of 1 or 16 (a request's slots contiguous
within a page, its pages scattered, page 0 the dummy page). Unused slots hold large garbage, so reading a wrong slot
shows. A tree mask transposed per request (descendants instead of ancestors) must fail every comparison.

float32 only: the interpreter's tl.dot on bf16 multiplies raw bit patterns (triton issue #11584).
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("JETFLOW_SKIP_SGLANG") == "1":
    pytest.skip("SGLang is not installed (JETFLOW_SKIP_SGLANG=1)", allow_module_level=True)
pytest.importorskip("sglang")
triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 (tests/conftest.py) or a GPU", allow_module_level=True)
DEV = torch.device("cpu" if INTERPRET else "cuda")

from jetflow_sglang.sglang.cpu import ops as cpu_ops  # noqa: E402

cpu_ops.install()  # stubs for sgl_kernel/torchvision before sglang.srt modules import them

from sglang.kernels.ops.attention import extend_attention as sgl_extend  # noqa: E402
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from jetflow_sglang.core.tree import DraftTree, ancestor_mask, pack_bits  # noqa: E402
from jetflow_sglang.core.tree_batch import TreeBatch  # noqa: E402
from experimental import flashinfer_path as fip  # noqa: E402
from jetflow_sglang.kernels import tree_mask as tm  # noqa: E402
from jetflow_sglang.kernels.reference import tree_attn_reference  # noqa: E402
from jetflow_sglang.sglang.attention.tree_native import TreeTorchNativeAttnBackend, window_mask  # noqa: E402
from jetflow_sglang.sglang.verify_input import JetFlowVerifyInput, verify_tensors  # noqa: E402

if INTERPRET and isinstance(sgl_extend._fwd_kernel, triton.runtime.jit.JITFunction):
    pytest.skip("SGLang's extend_attention was imported without TRITON_INTERPRET=1 earlier in this process",
                allow_module_level=True)

torch.set_num_threads(1)
TOL = 1e-5  # float32 (measured errors ~6e-7): triton (interpreted) and SDPA vs each other and the float64 oracle
HQ, HKV, D = 4, 2, 32  # GQA ratio 2

# (tree sizes inside the fixed n, committed prefix lengths L, n, page size)
CASES = {
    "page1": ([16, 5, 11, 1], [1, 9, 40, 23], 16, 1),
    "page16": ([7, 12, 3], [17, 3, 38], 12, 16),
    "page16_full_pages": ([16, 9], [16, 32], 16, 16),
}


# ----------------------------------------------------------------------------------------------------------------
# one verify batch: trees, a paged KV pool, JETFLOW's verify input
# ----------------------------------------------------------------------------------------------------------------
def random_tree(size: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, size)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    tokens = torch.randint(0, 1000, (size,), generator=g).tolist()
    return DraftTree(tokens=tokens, parents=parents, depths=depths, logps=[-0.1 * d for d in depths])


def make_case(sizes, prefix_lens, n, page, seed, transpose=False):
    g = torch.Generator().manual_seed(seed)
    b = len(sizes)
    tb = TreeBatch.from_trees([random_tree(s, g) for s in sizes], budget=n)
    anc = tb.ancestor_mask()  # what the worker hands verify_tensors
    if transpose:
        anc = anc.transpose(1, 2)
    seq_lens = torch.tensor(prefix_lens, dtype=torch.int64)
    max_len = max(prefix_lens)
    tokens, custom_mask, positions, r_index, r_next, r_sib = verify_tensors(
        tb.tokens, tb.parents, tb.depths, tb.sizes, anc, seq_lens, True, max_len)  # FULL, as on GPU

    # paged slots: request r's position p sits at table[r, p // page] * page + p % page; page 0 is the dummy page
    kv_lens = [L + n for L in prefix_lens]
    pages = [-(-kl // page) for kl in kv_lens]
    n_pages = 1 + sum(pages) + 3
    perm = (torch.randperm(n_pages - 1, generator=g) + 1)[:sum(pages)]
    table = torch.zeros(b, max(pages), dtype=torch.long)
    for r, chunk in enumerate(perm.split(pages)):
        table[r, :len(chunk)] = chunk
    pool_rows = b + 3
    req_pool_indices = torch.randperm(pool_rows, generator=g)[:b]  # rows of req_to_token, out of order
    width = max_len + n + 2 * page
    req_to_token = torch.zeros(pool_rows, width, dtype=torch.int32)  # unused entries name slot 0 (dummy)
    for r in range(b):
        pos = torch.arange(kv_lens[r])
        req_to_token[req_pool_indices[r], :kv_lens[r]] = (table[r, pos // page] * page + pos % page).to(torch.int32)

    n_slots = n_pages * page
    k_buf = 100 * torch.randn(n_slots, HKV, D, generator=g) + 50  # garbage wherever nothing is written
    v_buf = 100 * torch.randn(n_slots, HKV, D, generator=g) - 50
    for r in range(b):  # the committed prefix
        slots = req_to_token[req_pool_indices[r], :prefix_lens[r]].long()
        k_buf[slots] = torch.randn(len(slots), HKV, D, generator=g)
        v_buf[slots] = torch.randn(len(slots), HKV, D, generator=g)
    q = torch.randn(b * n, HQ, D, generator=g)
    k_ext = torch.randn(b * n, HKV, D, generator=g)
    v_ext = torch.randn(b * n, HKV, D, generator=g)
    out_cache_loc = torch.cat([req_to_token[req_pool_indices[r], L:L + n] for r, L in enumerate(prefix_lens)]).long()
    k_buf[out_cache_loc] = k_ext  # what set_kv_buffer does before either backend reads
    v_buf[out_cache_loc] = v_ext

    spec = JetFlowVerifyInput(draft_token=tokens, custom_mask=custom_mask, positions=positions,
                              retrieve_index=r_index, retrieve_next_token=r_next, retrieve_next_sibling=r_sib,
                              draft_token_num=n)
    c = SimpleNamespace(b=b, n=n, page=page, tb=tb, seq_lens=seq_lens, max_len=max_len, spec=spec,
                        req_to_token=req_to_token, req_pool_indices=req_pool_indices, out_cache_loc=out_cache_loc,
                        table=table, k_buf=k_buf, v_buf=v_buf, q=q, k_ext=k_ext, v_ext=v_ext,
                        scaling=1.0 / math.sqrt(D))
    return to_device(c)


def to_device(c):
    for name, val in vars(c).items():
        if isinstance(val, torch.Tensor):
            setattr(c, name, val.to(DEV))
    c.spec.custom_mask = c.spec.custom_mask.to(DEV)
    c.spec.device = DEV
    return c


def translator(c) -> KVIndexTranslator:
    """SGLang's own translator over a plain (static) pool: reads stay the req_to_token ids."""
    t = KVIndexTranslator(req_to_token=c.req_to_token, token_to_kv_pool_allocator=object(),
                          token_to_kv_pool=object(), page_size=c.page, device=str(DEV))
    assert not t.is_translating
    return t


# ----------------------------------------------------------------------------------------------------------------
# the three paths
# ----------------------------------------------------------------------------------------------------------------
def sglang_triton_verify(c, custom_mask=None):
    """TritonAttnBackend in TARGET_VERIFY, non-deterministic 2-stage path: init_forward_metadata's tensors, then
    forward_extend's extend_attention_fwd call (no sliding window, no logit cap, no sinks, k/v scale 1)."""
    b, n = c.b, c.n
    custom_mask = c.spec.custom_mask if custom_mask is None else custom_mask
    qo_indptr = torch.arange(0, (1 + b) * n, step=n, dtype=torch.int32, device=DEV)
    kv_indices = torch.empty(int(c.seq_lens.sum()), dtype=torch.int64, device=DEV)
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=DEV)
    kv_indptr[1:] = torch.cumsum(c.seq_lens, dim=0)  # _fill_kv_indptr_and_indices: committed tokens only
    translator(c).pack_read_stream(None, req_pool_indices=c.req_pool_indices, seq_lens=c.seq_lens,
                                   indptr=kv_indptr, out=kv_indices)
    mask_indptr = torch.zeros(b + 1, dtype=torch.int64, device=DEV)
    mask_indptr[1:] = torch.cumsum(n * (c.seq_lens + n), dim=0)
    o = torch.empty_like(c.q)
    sgl_extend.extend_attention_fwd(
        c.q, c.k_ext.contiguous(), c.v_ext.contiguous(), o, c.k_buf, c.v_buf, qo_indptr, kv_indptr, kv_indices,
        custom_mask, True, mask_indptr, n, 1.0, 1.0, c.scaling, logit_cap=0, sliding_window_size=-1, sinks=None,
        window_kv_offsets=None, xai_temperature_len=-1, page_size=c.page, score_mod=None, aux_tensors=None,
        extend_seq_lens_cpu=None)
    return o, kv_indices


class _Pool:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def tree_native(c, custom_mask=None):
    """jetflow_tree_native's TARGET_VERIFY forward (the KV already saved at out_cache_loc)."""
    backend = TreeTorchNativeAttnBackend.__new__(TreeTorchNativeAttnBackend)  # no model runner: only the pools
    backend.token_to_kv_pool = _Pool(c.k_buf, c.v_buf)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=c.req_to_token)
    backend.swa_out_cache_loc = None
    spec = SimpleNamespace(draft_token_num=c.n, custom_mask=c.spec.custom_mask if custom_mask is None else custom_mask)
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, seq_lens=c.seq_lens,
                         seq_lens_cpu=c.seq_lens.cpu(), req_pool_indices=c.req_pool_indices,
                         out_cache_loc=c.out_cache_loc)
    layer = SimpleNamespace(tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=c.scaling,
                            layer_id=0)
    out = backend.forward_extend(c.q.reshape(-1, HQ * D), c.k_ext.reshape(-1, HKV * D),
                                 c.v_ext.reshape(-1, HKV * D), layer, fb, save_kv_cache=False)
    return out.view(-1, HQ, D)


def oracle(c):
    """float64, from the trees' parents alone (core.tree.ancestor_mask, not TreeBatch's or verify_mask's)."""
    words = torch.cat([pack_bits(ancestor_mask(c.tb.parents[r].tolist()), tm.words_for(c.n)) for r in range(c.b)])
    qo_indptr = torch.arange(0, (c.b + 1) * c.n, step=c.n, dtype=torch.int32)
    k_cache = c.k_buf.cpu().view(-1, c.page, HKV, D)  # slot s = page s // page, offset s % page
    v_cache = c.v_buf.cpu().view(-1, c.page, HKV, D)
    return tree_attn_reference(c.q.cpu(), k_cache, v_cache, c.table.cpu(), c.seq_lens.cpu(), qo_indptr, words,
                               sm_scale=c.scaling)


def flashinfer_bits(c, custom_mask):
    """What FlashInfer's prefill kernel sees: SGLang's generate_attn_arg_prefill, plan(page_size=1)'s mask_indptr,
    segment_packbits(little); returns (kv_indptr, kv_indices, read(r, qo, kv) -> bool)."""
    spec = JetFlowVerifyInput(custom_mask=custom_mask, draft_token_num=c.n)
    kv_indices, kv_indptr, qo_indptr, mask = spec.generate_attn_arg_prefill(
        req_pool_indices=c.req_pool_indices, paged_kernel_lens=c.seq_lens,
        paged_kernel_lens_sum=int(c.seq_lens.sum()), translator=translator(c), plan=None)
    assert mask is custom_mask, "SGLang padded JETFLOW's mask: its length is not sum(n * (L + n))"
    qo_indptr, kv_indptr = qo_indptr.cpu().long(), kv_indptr.cpu().long()
    # flashinfer.prefill._compute_page_mask_indptr at SGLang's plan(page_size=1, last_page_len=1): kv_len = L + n
    kv_len = (kv_indptr[1:] - kv_indptr[:-1] - 1) * 1 + 1
    mask_indptr = torch.zeros(c.b + 1, dtype=torch.long)
    mask_indptr[1:] = torch.cumsum((qo_indptr[1:] - qo_indptr[:-1]) * kv_len, 0)
    assert mask_indptr.tolist() == fip.flashinfer_mask_indptr(qo_indptr, c.seq_lens.tolist()).tolist()
    try:
        from flashinfer.prefill import _compute_page_mask_indptr
    except ImportError:  # optional, GPU only
        pass
    else:
        assert _compute_page_mask_indptr(qo_indptr, kv_indptr, torch.ones_like(kv_len), 1).tolist() == \
            mask_indptr.tolist()
    packed, byte_indptr = fip.packbits_little(mask.cpu(), mask_indptr)

    def read(r, qo, kv):  # DefaultAttention::LogitsMask: segment r, bit qo * kv_len + kv
        return fip.flashinfer_mask_bit(packed, byte_indptr, r, qo, kv, int(kv_len[r]))

    return kv_indptr, kv_indices.cpu().long(), kv_len.tolist(), read


def flashinfer_allow(c, custom_mask):
    """[b, n, max_len + n] bool read back bit by bit through FlashInfer's addressing (False past each kv_len)."""
    kv_indptr, kv_indices, kv_len, read = flashinfer_bits(c, custom_mask)
    allow = torch.zeros(c.b, c.n, c.max_len + c.n, dtype=torch.bool)
    for r in range(c.b):
        for qo in range(c.n):
            for kv in range(kv_len[r]):
                allow[r, qo, kv] = read(r, qo, kv)
    return allow, kv_indptr, kv_indices


def flashinfer_emulated(c, custom_mask):
    """Attention over the slots generate_attn_arg_prefill's kv_indices name, masked by the FlashInfer bits."""
    allow, kv_indptr, kv_indices = flashinfer_allow(c, custom_mask)
    out = torch.empty(c.b * c.n, HQ, D)
    for r in range(c.b):
        slots = kv_indices[kv_indptr[r]:kv_indptr[r + 1]]
        kv_len = len(slots)
        k = c.k_buf.cpu()[slots].transpose(0, 1)
        v = c.v_buf.cpu()[slots].transpose(0, 1)
        q = c.q.cpu()[r * c.n:(r + 1) * c.n].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allow[r, :, :kv_len],
                                                             scale=c.scaling, enable_gqa=True)
        out[r * c.n:(r + 1) * c.n] = o.transpose(0, 1)
    return out


def assert_same(got, want, what):
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


# ----------------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_triton_extend_attention_matches_tree_native(case, seed):
    c = make_case(*CASES[case], seed=seed)
    assert c.spec.custom_mask.numel() == int((c.n * (c.seq_lens + c.n)).sum())  # FULL: mask_indptr's total
    got, kv_indices = sglang_triton_verify(c)
    # SGLang's KV stream for the triton verify is the committed prefix only; the draft rows come as k/v_extend
    want_idx = torch.cat([c.req_to_token[c.req_pool_indices[r], :L] for r, L in enumerate(c.seq_lens.tolist())])
    assert kv_indices.tolist() == want_idx.long().tolist()
    assert torch.isfinite(got).all()
    native = tree_native(c)
    ref = oracle(c)
    assert_same(got, ref, "SGLang triton extend_attention_fwd vs float64 oracle")
    assert_same(got, native, "SGLang triton extend_attention_fwd vs jetflow_tree_native")
    assert_same(native, ref, "jetflow_tree_native vs float64 oracle")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_flashinfer_addressing_reads_the_tree_native_mask(case, seed):
    c = make_case(*CASES[case], seed=seed)
    allow, kv_indptr, kv_indices = flashinfer_allow(c, c.spec.custom_mask)
    want = window_mask(c.spec.custom_mask, c.seq_lens, c.n, c.max_len).cpu()  # what jetflow_tree_native applies
    assert torch.equal(allow, want)
    # ... and that is the tree: prefix visible, ancestors-or-self inside the window, nothing past L + n
    for r, L in enumerate(c.seq_lens.tolist()):
        assert allow[r, :, :L].all() and not allow[r, :, L + c.n:].any()
        assert torch.equal(allow[r, :, L:L + c.n], ancestor_mask(c.tb.parents[r].tolist()))
    # FlashInfer's KV stream covers L + n per request and ends with the draft slots (out_cache_loc)
    assert (kv_indptr[1:] - kv_indptr[:-1]).tolist() == (c.seq_lens + c.n).tolist()
    tails = torch.cat([kv_indices[kv_indptr[r + 1] - c.n:kv_indptr[r + 1]] for r in range(c.b)])
    assert tails.tolist() == c.out_cache_loc.tolist()
    assert_same(flashinfer_emulated(c, c.spec.custom_mask), tree_native(c),
                "FlashInfer-addressed attention vs jetflow_tree_native")


@pytest.mark.parametrize("case", list(CASES))
def test_transposed_tree_mask_fails_both_contracts(case):
    """anc transposed per request before verify_tensors (descendants instead of ancestors): SGLang's kernels must
    then disagree with jetflow_tree_native on the true tree, i.e. the checks above can fail."""
    c = make_case(*CASES[case], seed=0)
    bad = make_case(*CASES[case], seed=0, transpose=True).spec.custom_mask
    assert bad.shape == c.spec.custom_mask.shape and not torch.equal(bad, c.spec.custom_mask)
    native = tree_native(c)

    got, _ = sglang_triton_verify(c, custom_mask=bad)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_same(got, native, "SGLang triton extend_attention_fwd (transposed mask) vs jetflow_tree_native")
    with pytest.raises(AssertionError, match="max abs error"):
        assert_same(got, oracle(c), "SGLang triton extend_attention_fwd (transposed mask) vs float64 oracle")

    allow, _, _ = flashinfer_allow(c, bad)
    assert not torch.equal(allow, window_mask(c.spec.custom_mask, c.seq_lens, c.n, c.max_len).cpu())
    with pytest.raises(AssertionError, match="max abs error"):
        assert_same(flashinfer_emulated(c, bad), native, "FlashInfer-addressed attention (transposed mask)")
