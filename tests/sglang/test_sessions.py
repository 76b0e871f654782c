"""Streaming sessions (`--enable-streaming-session`): each turn continues on the KV its session kept from the last
turn. JETFLOW's turns must read as plain SGLang's: a finished JETFLOW turn's last output token has a slot holding a
draft node's KV, which SGLang's session kept as that token's (jetflow_sglang/sglang/fixes/sessions.py), and later turns
parted from plain. Three-turn conversations on the default target with the shipped head, JETFLOW synchronous and on
the overlap scheduler, against the plain synchronous server."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import requests
import torch

from tests.sglang.sgl_server import chat_ids, default_target_servers

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
ARGS = ["--enable-streaming-session", "--max-running-requests", "8"]
PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.", "What is 12 times 7?",
           "Write a sentence about the sea."]
TURNS = ["And double it?", "Thanks. Now say it in words.", "One more time, briefly."]


@pytest.fixture(scope="module")
def servers(server_pool):
    yield from default_target_servers(server_pool, ARGS, {})


def _conversation(srv, first: list[int], turns: list[list[int]]) -> list[list[int]]:
    sid = srv.post("/open_session", {"capacity_of_str_len": 8000, "streaming": True}).json()
    try:
        outs = []
        for ids in [first, *turns]:
            out = srv.generate(input_ids=ids, session_params={"id": sid},
                               sampling_params={"max_new_tokens": 24, "temperature": 0})
            outs.append(out["output_ids"])
        return outs
    finally:
        requests.post(srv.url + "/close_session", json={"session_id": sid}, timeout=30)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_streaming_session_turns_match_plain(servers, mode):
    from transformers import AutoTokenizer

    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    tok = AutoTokenizer.from_pretrained(target)
    firsts = chat_ids(target, PROMPTS)
    turns = [tok(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
             for t in TURNS]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda f: _conversation(spec, f, turns), firsts))
    for first, conv in zip(firsts, got):
        assert conv == _conversation(plain, first, turns), tok.decode(first)
    assert all(len(t) > 0 for conv in got for t in conv)
