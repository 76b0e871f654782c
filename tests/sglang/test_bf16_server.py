"""A bfloat16 JETFLOW server, the dtype users serve in and the benchmarks run, against the plain bfloat16 server on the
default target with the shipped head. In bfloat16 a multi-row verify rounds differently from a one-token decode step,
so a greedy choice between two near-equal logits may flip (README, Numerics): each greedy output must equal plain's,
or part from it only where JETFLOW took another of plain's top five tokens within TIE nats of plain's first. Also
input_embeds requests (SGLang takes them in bfloat16 only, without the radix cache), sampled requests in the same
batch, and the chat route at its default temperature. JETFLOW synchronous with the radix cache, and on the overlap
scheduler without it; plain synchronous without it."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest
import torch

from tests.sglang.sgl_server import NO_TRITON, Server, chat_ids, jetflow_server, running

torch.set_num_threads(1)
if os.environ.get("JETFLOW_SKIP_SGLANG") != "1":
    import sglang  # noqa: F401

pytestmark = pytest.mark.slow
# bfloat16 keeps 8 significant bits: a logit between 16 and 32 (common here) is rounded to a step of 0.125, so a
# logprob may differ from plain's by about a step, and a gap between two logits by about two.
LOGPROB_TOL = 0.25
TIE = 0.3  # nats between plain's top two logprobs: rounding can flip a choice this close
MIN_COMPARED = 0.6  # share of plain's tokens that must come before the partings (see test_mixed_batch_like_plain)
BF16 = ["--dtype", "bfloat16"]
NO_RADIX = ["--disable-radix-cache"]
PROMPTS = ["Janet has 16 eggs and eats 3. How many are left?", "List three colors.", "What is 12 times 7?",
           "Write a sentence about the sea.", "Name a prime number.", "Say hello in French."]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from jetflow_sglang.paths import default_paths

    root = tmp_path_factory.mktemp("bf16")
    target, head = default_paths()

    def spec(name, env, *extra):  # jetflow_server's --dtype float32 is overridden by the later flag
        return jetflow_server(target, head, root / f"{name}.log", 8, *BF16, *extra, env={**NO_TRITON, **env})

    ups = (spec("sync", {"JETFLOW_OVERLAP": "off"}), spec("overlap", {"JETFLOW_OVERLAP": "on"}, *NO_RADIX),
           Server(str(target), [*BF16, *NO_RADIX, "--disable-overlap-schedule"], root / "plain.log", env=NO_TRITON))
    for up in running(*ups):
        yield (*up, str(target))


def assert_greedy_like_plain(got: dict, plain: dict) -> int:
    """got equals plain, or parts from it where got took another of plain's top tokens within TIE of plain's first
    (two or more near-equal tokens: rounding may pick any of them); the logprobs agree before that. Returns the tokens
    that agree."""
    a, b = got["output_ids"], plain["output_ids"]
    tops = plain["meta_info"]["output_top_logprobs"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if same is not None:
        (l1, t1, _), near = tops[same][0], {t: lp for lp, t, _ in tops[same][1:]}
        assert t1 == b[same] and a[same] in near and l1 - near[a[same]] < TIE, \
            f"token {same}: {a[same]} vs plain's {b[same]}, plain's top tokens {tops[same]}"
    else:
        same = len(b)
        assert len(a) == len(b) and got["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    la, lb = got["meta_info"]["output_token_logprobs"][:same], plain["meta_info"]["output_token_logprobs"][:same]
    assert all(abs(p[0] - q[0]) < LOGPROB_TOL for p, q in zip(la, lb))
    return same


def _reply(ids, logprobs, tops, finish="length") -> dict:
    return {"output_ids": ids, "meta_info": {"finish_reason": {"type": finish},
                                             "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)],
                                             "output_top_logprobs": tops}}


def test_the_comparison_itself():
    tops = [[[-0.1, 5, None], [-3.0, 6, None]], [[-1.0, 7, None], [-1.1, 8, None]], [[-0.5, 9, None], [-2, 1, None]]]
    plain = _reply([5, 7, 9], [-0.1, -1.0, -0.5], tops)
    assert assert_greedy_like_plain(_reply([5, 7, 9], [-0.12, -1.05, -0.6], tops), plain) == 3
    assert assert_greedy_like_plain(_reply([5, 8, 2], [-0.1, -1.1, -4.0], tops), plain) == 1  # a near tie flipped
    three = [tops[0], tops[1] + [[-1.2, 4, None]], tops[2]]  # three near-equal tokens: the third is a near tie too
    assert assert_greedy_like_plain(_reply([5, 4, 2], [-0.1, -1.2, -4.0], three), _reply([5, 7, 9], [-0.1, -1.0, -0.5],
                                                                                          three)) == 1
    for bad in (_reply([6, 7, 9], [-3.0, -1.0, -0.5], tops),  # a clear choice flipped
                _reply([5, 7, 1], [-0.1, -1.0, -2.0], tops),  # plain's second, but not a near tie
                _reply([5, 3, 9], [-0.1, -1.0, -0.5], tops),  # a token outside plain's top ones
                _reply([5, 7, 9], [-0.1, -2.0, -0.5], tops),  # a logprob off by a nat
                _reply([5, 7], [-0.1, -1.0], tops, "stop")):  # stopped early
        with pytest.raises(AssertionError):
            assert_greedy_like_plain(bad, plain)


_PLAIN: dict = {}  # the plain server's greedy answers, read once for both scheduler modes


def _plain(plain, body: dict) -> dict:
    import json

    key = json.dumps(body, sort_keys=True)
    if key not in _PLAIN:
        _PLAIN[key] = plain.generate(**body)
    return _PLAIN[key]


def _greedy(body: dict) -> dict:
    return {**body, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32}}


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_mixed_batch_like_plain(servers, mode):
    sync, overlap, plain, target = servers
    spec = sync if mode == "sync" else overlap
    greedy = [_greedy({"input_ids": ids}) for ids in chat_ids(target, PROMPTS)]
    sampled = [{"input_ids": ids, "sampling_params": {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32,
                                                      "ignore_eos": True}} for ids in chat_ids(target, PROMPTS[:2])]
    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda b: spec.generate(**b), greedy + sampled))
    refs = [_plain(plain, body) for body in greedy]
    agree = sum(assert_greedy_like_plain(a, b) for a, b in zip(got, refs))
    # most tokens are compared: each parting is a checked near tie, and where the texts part varies with the CPU's
    # bfloat16 kernels (100 of 143 tokens before the partings on a 2-core AMD EPYC on 2026-12-06, 75% or more on Xeons)
    assert agree >= MIN_COMPARED * sum(len(b["output_ids"]) for b in refs)
    assert all(len(a["output_ids"]) == 32 for a in got[len(greedy):])
    tokens = sum(len(a["output_ids"]) for a in got)
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got) < tokens  # drafts were accepted
    chat = spec.post("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi!"}],
                                              "max_tokens": 16})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]


def test_input_embeds_like_plain(servers):
    from safetensors import safe_open

    _, overlap, plain, target = servers
    with safe_open(f"{target}/model.safetensors", "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight").to(torch.bfloat16).float()
    bodies = [_greedy({"input_embeds": table[ids].tolist()}) for ids in chat_ids(target, PROMPTS[:3])]
    with cf.ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda b: overlap.generate(**b), bodies))
    refs = [plain.generate(**body) for body in bodies]
    agree = sum(assert_greedy_like_plain(a, b) for a, b in zip(got, refs))
    assert agree >= MIN_COMPARED * sum(len(b["output_ids"]) for b in refs)
    assert sum(a["meta_info"]["spec_verify_ct"] for a in got) < sum(len(a["output_ids"]) for a in got)
