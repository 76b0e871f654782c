"""The largest budget a server takes (`--speculative-num-draft-tokens 256`), on real SGLang servers with a tiny random
Qwen3 target and a tiny head: synchronous on a page-1 pool and on the overlap scheduler on 16-token pages. A mixed
batch (greedy with logprobs, sampled) must give the plain server's greedy tokens and logprobs, and the rounds must
have verified full 256-node trees (the worker's own record in /server_info), not trees cut down by the KV reservation
or the context room."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import requests
import torch

from tests.sglang.sgl_fixtures import shared_head, shared_tiny
from tests.sglang.sgl_server import plain_tiny

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
BUDGET, NEW = 256, 24
PROMPTS = ["The quick brown fox jumps over", "def fib(n):\n    return", "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def servers(server_pool):
    target = shared_tiny()
    head = str(shared_head(target))

    def jetflow(mode, *extra):
        return server_pool.get(target, ["--dtype", "float32", "--speculative-algorithm", "JETFLOW",
                                        "--speculative-draft-model-path", head, "--speculative-num-draft-tokens",
                                        str(BUDGET), *extra], env={"JETFLOW_OVERLAP": "on" if mode == "overlap"
                                                                    else "off"}, name=f"full-{mode}", shared=False)

    plain = plain_tiny(server_pool, target)
    with server_pool.use(plain, jetflow("sync"), jetflow("overlap", "--page-size", "16")) as up:
        yield (*up, target)


def _ids(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p).input_ids for p in PROMPTS]


def _bodies(ids):
    greedy = [dict(input_ids=i, return_logprob=True, top_logprobs_num=2,
                   sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}) for i in ids]
    sampled = dict(input_ids=ids[0], sampling_params={"max_new_tokens": NEW, "temperature": 0.9, "top_p": 0.95,
                                                      "ignore_eos": True})
    return greedy, sampled


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_budget_256_matches_plain_with_full_trees(servers, mode):
    plain, sync, overlap, target = servers
    spec = sync if mode == "sync" else overlap
    greedy, sampled = _bodies(_ids(target))
    want = [plain.generate(**b) for b in greedy]
    with cf.ThreadPoolExecutor(4) as ex:  # one batch: three greedy requests and a sampled one
        got = list(ex.map(lambda b: spec.generate(**b), greedy + [sampled]))
    for a, w in zip(got, want):
        assert a["output_ids"] == w["output_ids"], mode
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_w = [x[0] for x in w["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_w)) < 1e-3, mode
        tops_a = [[t[1] for t in row] for row in a["meta_info"]["output_top_logprobs"]]
        assert tops_a == [[t[1] for t in row] for row in w["meta_info"]["output_top_logprobs"]], mode
        assert a["meta_info"]["spec_verify_ct"] > 0
    assert len(got[-1]["output_ids"]) == NEW
    budgets = spec.jetflow_state()["recent_budgets"]
    assert max(budgets) == BUDGET, budgets  # full trees were verified
    assert requests.get(spec.url + "/health", timeout=30).status_code == 200
