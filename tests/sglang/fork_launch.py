"""`python -m sglang.launch_server`, for the tests, with SGLang's scheduler and detokenizer processes forked from the
launcher instead of spawned.

A spawned child imports SGLang again: about 9 CPU-seconds each on a 2-core EPYC, so about 30 of the 43 CPU-seconds a
tiny server took to get ready were the same imports three times (the launcher, the scheduler, the detokenizer). Here
the launcher imports the scheduler's and detokenizer's modules once, before SGLang forces "spawn", and every child is
forked from it: 14 CPU-seconds until ready, the same answers. On a CPU nothing else changes (there is no CUDA context
to inherit). What fork would hide: a patch or registration that a spawned child fails to make itself, inherited here
from the launcher. The servers whose subject is start-up itself launch as users do (sgl_server.Server(spawn=True)):
the end-to-end module's JETFLOW servers (both schedulers), the plugin's scope (a plain server with and without the
plugin), tokenizer workers and TP/DP; so do the benchmark's and the GPU check's. JETFLOW_TEST_LAUNCH=spawn launches
every test server that way.

Usage: python tests/sglang/fork_launch.py <sglang.launch_server arguments>
"""
import multiprocessing
import runpy
import sys

_set_start_method = multiprocessing.set_start_method


def _fork_instead(method=None, force=False):  # SGLang calls set_start_method("spawn", force=True) in its launcher
    return _set_start_method("fork", force=True)


if __name__ == "__main__":
    multiprocessing.set_start_method = _fork_instead
    import sglang.srt.managers.detokenizer_manager  # noqa: F401  (the children's modules, imported once here)
    import sglang.srt.managers.scheduler  # noqa: F401

    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
