"""One place that keeps single requests from hurting the server (installed in the processes of JETFLOW servers and
Engines; in every SGLang server with the opt-in JETFLOW_GUARD_ALL=1, see plugin.py).

1. Token ids. SGLang 0.5.23 validates prompt length and sampling parameters in its tokenizer manager, but an empty
   prompt (`{"text": ""}`) and token ids outside the vocabulary (`{"input_ids": [1, 2, 60000]}`) reach the scheduler,
   where the rotary embedding / embedding lookup raises and the scheduler process exits (with or without JETFLOW).
   `TokenizerManager._validate_one_request`, which every generate path (text, token ids, batches, OpenAI completions
   and chat) calls with the final token ids, is wrapped to raise ValueError there; SGLang answers it with HTTP 400.
2. Limits SGLang 0.5.23 does not check, each of which takes a scheduler down (or, for `n`, lets one request queue
   unbounded work): `top_k` above int32 (overflow in the scheduler's sampling tensors), top logprobs beyond the
   vocabulary ("selected index k out of range"), a negative `logprob_start_len` other than -1 (an assertion in the
   logprob result processing of speculative servers), and `n` above MAX_N. Checked in the same wrapper as 1, with a
   one-line ValueError that names the field (HTTP 400). `top_k` between the vocabulary and int32 stays allowed: the
   plain server treats it as the whole vocabulary, and clients send such values.
3. `input_embeds` (served with `--disable-radix-cache`). Rows of the wrong width or of unequal widths end the
   scheduler in the first layer, and SGLang casts every input_embeds batch to bfloat16
   (`ModelRunner._extend_forward_kwargs`), so a float32 or float16 model's first layer fails on any of them. Checked
   in the same wrapper: a 400 naming the model's hidden size or dtype. (An empty list gets SGLang's own 500 before
   the wrapper runs; the server stays up.)
4. `--tokenizer-worker-num N` (N > 1): SGLang's HTTP tokenizer workers load the plugins too.
   
   SGLang 0.5.23 calls `load_plugins()` in the launcher, the schedulers and the detokenizer, but not in the tokenizer
   workers that uvicorn spawns in multi-tokenizer mode (upstream PR sgl-project/sglang#38464 is open). There the
   tokenizer manager's `compute_num_reserved_tokens` looks up the speculative algorithm by name, so a JETFLOW server
   did not start ("Unknown speculative algorithm name: JETFLOW"), and a plain one ran its workers without the request
   guard.
   
   Each worker's first step is to unpickle, from shared memory, the (port_args, server_args, scheduler_info) that the
   launcher wrote with `write_data_for_multi_tokenizer`. The launcher's copy of that function is wrapped to hand over
   `scheduler_info` as a dict whose unpickling runs `load_plugins()` first and then gives the plain dict back. So the
   plugins load in each worker before its tokenizer manager is built, with the request guard that the launcher has (it
   hands over this dict only where the guard is installed: JETFLOW servers, or JETFLOW_GUARD_ALL=1), and nothing else
   in the worker changes.

Not guarded: bodies that are not JSON objects (`[1, 2]` to an OpenAI route) or whose nested values crash FastAPI's body
validation (`"response_format": "abc"`) get SGLang's own HTTP 500 and the server stays up, exactly as on a plain
server; docs/UPSTREAM.md describes the upstream change that would make them a 400.
"""
from __future__ import annotations

import importlib
import sys

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
HTTP_MODULE = "sglang.srt.entrypoints.http_server"
MAX_N = 128  # parallel samples per request (`n`); OpenAI's own limit
INT32_MAX = 2**31 - 1


def check_input_ids(input_ids, vocab_size: int | None) -> None:
    """Raise ValueError (one line) for an empty prompt or a token id outside [0, vocab_size)."""
    if input_ids is None:
        return  # input_embeds requests: nothing to check here
    if len(input_ids) == 0:
        raise ValueError("The prompt is empty: send at least one token (text that tokenizes to nothing, or an "
                         "empty input_ids list, cannot be generated from)")
    if vocab_size is None:
        return
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab_size:
            raise ValueError(f"input_ids[{i}] = {t!r} is not a token id of this model (valid: 0 to {vocab_size - 1})")


def check_limits(obj, vocab_size: int | None) -> None:
    """Raise ValueError (one line, naming the field) for the sampling and logprob values in section 2 above.
    obj: one (already split) GenerateReqInput; its sampling_params is a dict."""
    params = getattr(obj, "sampling_params", None) or {}
    if not isinstance(params, dict):
        return
    top_k = params.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and not -1 <= top_k <= INT32_MAX:
        raise ValueError(f"top_k = {top_k} is out of range: use -1 (whole vocabulary) or 1 to {INT32_MAX}")
    n = params.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise ValueError(f"n = {n} is above this server's limit of {MAX_N} parallel samples per request")
    start = getattr(obj, "logprob_start_len", None)
    if isinstance(start, int) and start < -1:
        raise ValueError(f"logprob_start_len = {start} is invalid: use -1 (from the first generated token) or a "
                         "prompt position >= 0")
    top = getattr(obj, "top_logprobs_num", None)
    if vocab_size and isinstance(top, int) and top > vocab_size:
        raise ValueError(f"top_logprobs_num (top_logprobs) = {top} is above the vocabulary size {vocab_size}")


def check_input_embeds(embeds, hidden_size: int | None, dtype) -> None:
    """Raise ValueError (one line) for the input_embeds of section 3 above; None (token input) passes."""
    if embeds is None:
        return
    if len(embeds) == 0:
        raise ValueError("input_embeds is empty: send at least one row")
    if hidden_size:
        for i, row in enumerate(embeds):
            if not isinstance(row, (list, tuple)) or len(row) != hidden_size:
                width = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
                raise ValueError(f"input_embeds[{i}] has {width} values; this model's rows have {hidden_size} "
                                 "(its hidden size)")
    if dtype is not None and str(dtype) != "torch.bfloat16":
        raise ValueError(f"input_embeds need a bfloat16 model in SGLang 0.5.23, which casts them to bfloat16; this "
                         f"server runs {str(dtype).replace('torch.', '')} (launch it with --dtype bfloat16)")


def _around_validate(original, self, obj, input_ids, *args, **kwargs):
    cfg = getattr(self, "model_config", None)  # the tokenizer manager's ModelConfig
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) or None
    check_input_ids(input_ids, vocab)
    check_limits(obj, vocab)
    check_input_embeds(getattr(obj, "input_embeds", None), getattr(cfg, "hidden_size", None),
                       getattr(cfg, "dtype", None))
    return original(self, obj, input_ids, *args, **kwargs)


# -- 4. tokenizer workers ----------------------------------------------------------------------------------------
def _load_plugins_then(info: dict) -> dict:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    install()  # what a JETFLOW server's (or a JETFLOW_GUARD_ALL=1 server's) tokenizer needs
    return info


class _LoadsPlugins(dict):
    """scheduler_info as the launcher hands it to the tokenizer workers: unpickling it loads the plugins first."""

    def __reduce__(self):
        return _load_plugins_then, (dict(self),)


def _install_tokenizer_workers(http_server) -> None:
    """Wrap http_server's `write_data_for_multi_tokenizer` (the launcher's; called once, before the workers start)."""
    from jetflow_sglang.sglang.compat import wrap

    def make(original):
        def write_data_for_multi_tokenizer(port_args, server_args, scheduler_info):
            return original(port_args, server_args, _LoadsPlugins(scheduler_info))

        return write_data_for_multi_tokenizer

    wrap(http_server, "write_data_for_multi_tokenizer", make)


def install(launcher: bool = False) -> None:
    """Wrap the tokenizer manager's request check (sections 1-3) and, in an HTTP server's launcher, the hand-over to
    its tokenizer workers (section 4): `launcher` is the CLI's process (`sglang serve`, `python -m
    sglang.launch_server`), which imports SGLang's http_server right after the arguments resolve; a program that
    calls http_server.launch_server has imported it already. Once per process."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from jetflow_sglang.sglang.compat import wrap

    def make(original):
        def _validate_one_request(self, obj, input_ids, *args, **kwargs):
            return _around_validate(original, self, obj, input_ids, *args, **kwargs)
        return _validate_one_request

    wrap(TokenizerManager, "_validate_one_request", make)
    if launcher or HTTP_MODULE in sys.modules:  # an Engine without HTTP has no tokenizer workers to hand over to
        _install_tokenizer_workers(importlib.import_module(HTTP_MODULE))
