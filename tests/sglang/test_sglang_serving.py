"""JETFLOW serving behaviour on a real CPU server: `auto` falls back to plain decoding when speculation cannot pay,
and a nearly full KV pool shrinks the tree (down to plain decoding) instead of failing.

One JETFLOW server (auto, an untrained head whose drafts are almost never accepted and a cost prior that makes trees
look expensive, a 4096-token KV pool, a context longer than the pool) and one plain server with the same pool."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests
import torch

from tests.sglang.sgl_fixtures import hf_greedy, shared_tiny  # noqa: E402
from tests.sglang.sgl_server import LONG_ENV, Server, plain_tiny  # noqa: E402

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
# verified tokens -> seconds: a tree of 2+ nodes per request costs 50x a plain step, so no budget >= 2 can pay
EXPENSIVE_TREES = {1: 0.001, 2: 0.05, 64: 1.6, 256: 6.4}
POOL = ["--max-total-tokens", "4096", "--context-length", "4400"]


def build_untrained_head(target_dir, out) -> Path:
    """A randomly initialised head: speculation cannot pay with it, so `auto` must end up decoding plainly."""
    from transformers import AutoModelForCausalLM

    from jetflow_sglang.head import JetFlowHead, JetFlowHeadConfig, save_head

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = JetFlowHeadConfig.for_target(target.config, num_layers=1, n_taps=2, causal=True, block_size=8)
    cfg.tap_layers = [1, 2]
    torch.manual_seed(5)
    save_head(JetFlowHead(cfg), out, dtype=torch.float32)
    return Path(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = shared_tiny()
    return str(target), str(build_untrained_head(target, tmp_path_factory.mktemp("sgl_models") / "untrained-head"))


@pytest.fixture(scope="module")
def servers(models, server_pool):
    target, head = models
    spec = server_pool.get(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                    "--speculative-draft-model-path", head, "--speculative-num-draft-tokens", "8",
                                    *POOL], env={"JETFLOW_BUDGET": "auto", "JETFLOW_COST_PRIOR":
                                                 json.dumps(EXPENSIVE_TREES), **LONG_ENV},
                           name="serving-auto", shared=False)
    with server_pool.use(spec, plain_tiny(server_pool, target)) as up:
        yield up


def test_auto_falls_back_to_plain_decoding(servers, models):
    """Batch 1 with an untrained head: a tree costs a head forward and a larger verify for ~no accepted draft, so
    `auto` must decode plainly (budget 0/1) nearly always; the output stays exactly greedy."""
    spec, _ = servers
    before = spec.jetflow_state()
    prompts = [[5 + i, 17, 42, 99, 3 * i + 1] for i in range(3)]
    outs = [spec.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
            for ids in prompts]
    after = spec.jetflow_state()
    plain_steps = after["plain_steps"] - before["plain_steps"]
    steps = after["steps"] - before["steps"]
    assert steps >= 60 and plain_steps >= 0.75 * steps, after  # a few exploring rounds may try a tree
    assert sum(b <= 1 for b in after["recent_budgets"][-8:]) >= 6, after["recent_budgets"]
    auto = after["auto"]  # the controller's own view: plain decoding is its best estimated rate
    assert auto["rounds"] >= steps and auto["current"] in (0, 1), auto
    rates = {int(b): r["tokens_per_s"] for b, r in auto["budgets"].items() if r["tokens_per_s"] is not None}
    plain_rate = max(rates.get(0, 0.0), rates.get(1, 0.0))
    assert all(r <= plain_rate / 0.95 for b, r in rates.items() if b > 1), auto  # within the 5% hysteresis at most
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(models[0], ids, 24, stop_at_eos=False)


def test_nearly_full_pool_shrinks_the_tree_instead_of_failing(servers):
    """A 4001-token prompt asking for 200 tokens in a 4096-token pool: JETFLOW returns what the plain server
    returns (it stops where the pool ends) instead of a 500 'out of memory even after retracting'."""
    spec, plain = servers
    ids = [(7 * i) % 300 + 20 for i in range(4001)]
    body = dict(input_ids=ids, sampling_params={"max_new_tokens": 200, "temperature": 0, "ignore_eos": True})
    b = plain.post("/generate", body)
    a = spec.post("/generate", body)
    assert a.status_code == b.status_code, (a.status_code, a.text[:300], b.status_code)
    if b.ok:
        assert a.json()["output_ids"] == b.json()["output_ids"]
        assert a.json()["meta_info"]["finish_reason"] == b.json()["meta_info"]["finish_reason"]
    assert requests.get(spec.url + "/health", timeout=30).ok
    ok = spec.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert len(ok["output_ids"]) >= 1


# -- the worker's device-side pieces, against the host reference implementations (no server) ---------------------
def _random_trees(b=5, depth=4, width=3, vocab=11, budget=9, seed=0):
    from jetflow_sglang.core.tree_batch import build_topb

    g = torch.Generator().manual_seed(seed)
    anchor = torch.randint(0, vocab, (b,), generator=g)
    lps = torch.randn(b, depth, width, generator=g).log_softmax(-1).sort(-1, descending=True).values
    toks = torch.stack([torch.stack([torch.randperm(vocab, generator=g)[:width] for _ in range(depth)])
                        for _ in range(b)])
    return build_topb(anchor, toks, lps, budget)


def test_device_greedy_accept_matches_host_rule():
    from jetflow_sglang.core.verify import greedy_accept, greedy_accept_batch
    from jetflow_sglang.sglang.accept import to_sglang

    tb = _random_trees()
    b, n = tb.tokens.shape
    g = torch.Generator().manual_seed(1)
    argmax = torch.randint(0, 11, (b, n), generator=g)
    for i in range(b):  # plant accepted chains of different lengths
        t, node = tb.tree(i), 0
        for _ in range(i % 4):
            kids = t.children(node)
            if not kids:
                break
            node = kids[-1]
            argmax[i, t.parents[node]] = t.tokens[node]
    path, _, bonus = greedy_accept_batch(tb, argmax)  # the one batched greedy acceptor (engine and worker)
    predict, accept_index, accept_lens, emitted = to_sglang(tb.tokens, path, bonus, n)
    for i in range(b):
        t = tb.tree(i)
        ref_path, ref_bonus = greedy_accept(t, argmax[i, :len(t)].tolist())
        assert [x for x in path[i].tolist() if x >= 0] == ref_path
        toks = [t.tokens[x] for x in ref_path[1:]] + [ref_bonus]
        assert int(accept_lens[i]) == len(ref_path)
        assert emitted[i, :len(toks)].tolist() == toks
        assert predict[accept_index[i, :len(toks)].long()].tolist() == toks


def test_device_rejection_sampling_follows_the_target():
    from jetflow_sglang.core.verify import sample_accept_batch
    from jetflow_sglang.sglang.accept import to_sglang

    tb = _random_trees(b=1, depth=3, width=3, vocab=6, budget=8, seed=2)
    reps = 20000
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(1, 8, 6, generator=g) ** 2
    probs = probs / probs.sum(-1, keepdim=True)
    rep = lambda x: x.expand(reps, *x.shape[1:]).contiguous()  # noqa: E731
    chosen, bonus = sample_accept_batch(rep(tb.tokens), rep(tb.parents), tb.sizes.expand(reps), rep(probs), 3, 3, g)
    path = torch.cat([torch.zeros_like(chosen[:, :1]), chosen], 1)
    _, _, lens, emitted = to_sglang(rep(tb.tokens), path, bonus, 8)
    first = torch.bincount(emitted[:, 0], minlength=6).float() / reps
    p0 = probs[0, 0]
    assert ((first - p0).abs() / (p0 * (1 - p0) / reps).sqrt()).max() < 4.5  # the root's distribution exactly
    t = tb.tree(0)
    for c in t.children(0):  # the next token, given an accepted child, follows that child's distribution
        sel = (emitted[:, 0] == t.tokens[c]) & (lens >= 2)
        second = torch.bincount(emitted[sel, 1], minlength=6).float() / sel.sum()
        pc = probs[0, c]
        assert ((second - pc).abs() / (pc * (1 - pc) / sel.sum()).sqrt().clamp(min=1e-9)).max() < 4.5


def test_verify_mask_and_links_on_device():
    from jetflow_sglang.sglang.cpu import ops as cpu_ops

    cpu_ops.install()  # verify_input imports SGLang's spec modules (sgl_kernel/torchvision shims on CPU)
    from jetflow_sglang.sglang.verify_input import tree_links, verify_mask

    tb = _random_trees()
    n = tb.tokens.shape[1]
    first, sib = tree_links(tb.parents, tb.sizes)
    for i in range(tb.batch):
        t = tb.tree(i)
        for node in range(len(t)):
            kids = t.children(node)
            assert first[i, node] == (kids[0] if kids else -1)
            for a, c in zip(kids, kids[1:]):
                assert sib[i, a] == c
    anc, lens = tb.ancestor_mask(), torch.tensor([3, 0, 5, 2, 1])
    full = verify_mask(anc, lens, True, 5)
    ref = torch.cat([torch.cat([torch.ones(n, int(L), dtype=torch.bool), anc[i]], 1).flatten()
                     for i, L in enumerate(lens)])
    assert torch.equal(full, ref)
    assert torch.equal(verify_mask(anc, lens, True, 7, 11), ref)  # bounds above the lengths change nothing...
    loose = verify_mask(anc, lens, True, 7, 14)  # ... but a larger total (the overlap scheduler's bound) leaves
    assert torch.equal(loose[:ref.numel()], ref) and not loose[ref.numel():].any()  # unread False at the end
    assert loose.numel() == n * (14 + 5 * n)  # what SGLang's backend sizes from its host sum
    assert torch.equal(verify_mask(anc, lens, False), anc.reshape(-1))
    for short in ((4, 11), (5, 10)):  # a short bound (the longest, or the sum) is refused, never padded
        with pytest.raises(RuntimeError, match="host bound is below"):
            verify_mask(anc, lens, True, *short)


# -- sampled traffic on one-node rounds (the OpenAI routes default to temperature 1.0) -------------------------------
def _mixed_traffic(srv, models) -> None:
    """Sampled OpenAI calls with no temperature, sampled /generate calls and greedy /generate calls, all at once, so
    the scheduler batches greedy and sampled requests into the same rounds. Every call must succeed, the greedy
    ones must stay exactly greedy, and the server must stay healthy."""
    import concurrent.futures as cf

    model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 16}
    greedy_ids = [[9, 17, 42, 99], [33, 5, 250, 8]]

    def call(i):
        if i % 4 == 0:  # the OpenAI routes' defaults: temperature 1.0, top_p 1.0
            r = requests.post(srv.url + "/v1/chat/completions", json=chat, timeout=300)
        elif i % 4 == 1:
            r = requests.post(srv.url + "/v1/completions", json={"model": model, "prompt": "Once upon", "max_tokens": 16},
                              timeout=300)
        elif i % 4 == 2:
            r = srv.post("/generate", {"input_ids": greedy_ids[(i // 4) % 2],
                                       "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        else:
            r = srv.post("/generate", {"text": "1 2 3", "sampling_params": {"max_new_tokens": 16, "temperature": 0.8,
                                                                            "top_p": 0.9, "top_k": 20}})
        return i, r.status_code, r.json()

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(16)))
    for i, status, body in results:
        assert status == 200, (i, status, body, srv.tail())
        if i % 4 == 2:
            ids = greedy_ids[(i // 4) % 2]
            assert body["output_ids"] == hf_greedy(models[0], ids, 16, stop_at_eos=False), i
        elif i % 4 == 0:
            assert body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"] >= 1
    assert requests.get(srv.url + "/health", timeout=30).ok


def test_sampled_requests_on_an_auto_server_that_decodes_plainly(servers, models):
    """`auto` here decodes nearly every round with a one-node tree (budget 0/1): the rounds where sampled requests
    used to lose their root (accept length 0) and take the scheduler down."""
    spec, _ = servers
    before = spec.jetflow_state()
    _mixed_traffic(spec, models)
    after = spec.jetflow_state()
    assert after["plain_steps"] - before["plain_steps"] >= 10, after  # one-node rounds really ran


@pytest.fixture(scope="module")
def one_node_server(models, tmp_path_factory):
    """`--speculative-num-draft-tokens 1`: every round is a one-node tree."""
    target, head = models
    srv = Server(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW", "--speculative-draft-model-path",
                          head, "--speculative-num-draft-tokens", "1", "--max-running-requests", "8"],
                 tmp_path_factory.mktemp("sgl_logs1") / "one_node.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_sampled_requests_on_one_node_trees(one_node_server, models):
    _mixed_traffic(one_node_server, models)
    info = requests.get(one_node_server.url + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["jetflow"]["recent_budgets"][-1] == 1
