"""`--tokenizer-worker-num N` (N > 1): SGLang's HTTP tokenizer workers load the plugins too.

SGLang 0.5.23 calls `load_plugins()` in the launcher, the schedulers and the detokenizer, but not in the tokenizer
workers that uvicorn spawns in multi-tokenizer mode (upstream PR sgl-project/sglang#38464 is open). There the
tokenizer manager's `compute_num_reserved_tokens` looks up the speculative algorithm by name, so a JETFLOW server
did not start ("Unknown speculative algorithm name: JETFLOW"), and a plain one ran its workers without the request
guard.

Each worker's first step is to unpickle, from shared memory, the (port_args, server_args, scheduler_info) that the
launcher wrote with `write_data_for_multi_tokenizer`. The launcher's copy of that function is wrapped to hand over
`scheduler_info` as a dict whose unpickling runs `load_plugins()` first and then gives the plain dict back. So the
plugins load in each worker before its tokenizer manager is built, and nothing else in the worker changes.
"""
from __future__ import annotations


def _load_plugins_then(info: dict) -> dict:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return info


class _LoadsPlugins(dict):
    """scheduler_info as the launcher hands it to the tokenizer workers: unpickling it loads the plugins first."""

    def __reduce__(self):
        return _load_plugins_then, (dict(self),)


def install(http_server) -> None:
    """Wrap http_server's `write_data_for_multi_tokenizer` (the launcher's; called once, before the workers start)."""
    from jetflow_sglang.sglang.compat import wrap

    def make(original):
        def write_data_for_multi_tokenizer(port_args, server_args, scheduler_info):
            return original(port_args, server_args, _LoadsPlugins(scheduler_info))

        return write_data_for_multi_tokenizer

    wrap(http_server, "write_data_for_multi_tokenizer", make)
