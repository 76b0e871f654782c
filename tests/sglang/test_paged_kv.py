"""JETFLOW with `--page-size 4` (a paged KV pool) on CPU, on the default target with the shipped head: a paged JETFLOW
server died at its first decode (SGLang's speculative KV reservation looked up each request's last slot with a Triton
kernel: cpu/paging.py; the Triton interpreter that tests/conftest.py turns on hid it). Now greedy output equals the plain paged
server's, synchronous and on the overlap scheduler, in mixed greedy + sampled batches, with trees spanning page
boundaries and a radix-cache hit."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import torch

from tests.sglang.sgl_server import chat_ids, default_target_servers

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
PAGED = ["--page-size", "4", "--max-running-requests", "8"]
PROMPTS = ["Write the alphabet: A B C D E F", "List three colors.", "What is 2 + 2?", "Name a fruit."]


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, PAGED, {})


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_paged_jetflow_matches_plain_in_mixed_batches(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    ids = chat_ids(target, PROMPTS)
    greedy = [dict(input_ids=i, sampling_params={"max_new_tokens": 23, "temperature": 0, "ignore_eos": True})
              for i in ids]
    sampled = [dict(input_ids=i, sampling_params={"max_new_tokens": 23, "temperature": 0.8, "top_p": 0.9,
                                                  "ignore_eos": True}) for i in ids[:2]]
    for _ in range(2):  # the second pass hits the radix cache
        with cf.ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda b: spec.generate(**b), greedy + sampled))
        for body, a in zip(greedy, got):
            assert a["output_ids"] == plain.generate(**body)["output_ids"], body
        assert all(len(a["output_ids"]) == 23 for a in got[len(greedy):])
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got[:len(greedy)]) < 4 * 22  # drafts were accepted
