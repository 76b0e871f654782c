"""SGLang plugin entry point (group `sglang.srt.plugins`, see pyproject.toml). SGLang calls `register()` in every
process it starts (launcher, engine, scheduler, detokenizer), before it resolves the server arguments:

    python -m sglang.launch_server --model-path M --speculative-algorithm JETFLOW \
        --speculative-draft-model-path HEAD_DIR --device cpu ...

In every process it only registers, through SGLang's plugin API, what acts when a launch names JETFLOW:
  - the JETFLOW algorithm (worker: jetflow_sglang.sglang.worker.JetFlowWorker);
  - the tree-verify attention backends `jetflow_tree_native` (SDPA; CPU default) and `jetflow_tree_triton`;
  - two resolution-step wrappers that return at once for other algorithms: the config check (before
    `handle_speculative_decoding`, so a bad JETFLOW setting, a missing head folder or a head whose files do not fit
    the target (check_head) fails with one line before SGLang looks the head up on the hub or loads the target) and
    the attention-backend guard (attention/guard.py).

The run-time patches (compat.PATCHES) go only into the processes of a JETFLOW server or Engine (`install_patches`):
  - the launcher or Engine, when its arguments resolve to JETFLOW (the config check);
  - the processes SGLang spawns for it (schedulers, detokenizer, DP controller), whose launch arguments hold the
    server's ServerArgs (`_spawned_for_jetflow`);
  - the HTTP tokenizer workers of --tokenizer-worker-num, through the hand-over in fixes/request_guard.py.
A plain, EAGLE, NGRAM or DFLASH server in the same environment runs unchanged. JETFLOW_GUARD_ALL=1 opts every
server's processes into the request guard (fixes/request_guard.py).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from jetflow_sglang.sglang.config import ALGORITHM, is_jetflow

logger = logging.getLogger(__name__)
CONFIG_HOOK = "handle_speculative_decoding"


def _in_cli() -> bool:
    """True in `python -m sglang.launch_server` / `sglang serve`, where a bad setting should print one line and exit
    instead of a traceback; inside a Python program (sgl.Engine) the error is raised as an exception instead."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("sglang.launch_server", "sglang.cli", "sglang"):
        return True
    return Path(sys.argv[0] if sys.argv else "").name in ("sglang", "launch_server.py")


def _cli_launcher() -> bool:
    """The CLI's own process (not a scheduler or worker that multiprocessing started from it)."""
    import multiprocessing

    return _in_cli() and multiprocessing.parent_process() is None


def fail(err: Exception):
    """Report a JETFLOW launch error: one line on stderr and exit code 2 in the CLI, the exception otherwise."""
    if _in_cli():
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    raise err


def resolve_config(server_args, env=None):
    """The JetFlowServerConfig of a JETFLOW launch (head folder and drafter fit checked, and the head's files against
    the target's config.json: check_head); errors go through `fail`."""
    from jetflow_sglang.sglang.config import JetFlowConfigError, JetFlowServerConfig

    try:
        cfg = JetFlowServerConfig.from_server_args(server_args, env=env)  # reads the head's config.json too
        if cfg.needs_head and cfg.head_dir:
            check_head(server_args, cfg.head_dir)
    except JetFlowConfigError as e:
        fail(e)
    return cfg


def check_head(server_args, head_dir: str) -> None:
    """The head's files against the target's config.json (--model-path), before SGLang loads anything: hidden size,
    vocabulary, tap layers SGLang can capture, readable and complete safetensors with the tensors the config implies
    (head/check.py). A target that is not a local folder or cached repo is left to SGLang; the head is still checked.
    One-line JetFlowConfigError naming both values."""
    from jetflow_sglang.sglang.config import JetFlowConfigError
    from jetflow_sglang.head import CheckpointError, HeadMismatchError, check_head_files
    from jetflow_sglang.head.check import target_config_of

    snap = getattr(server_args, "_raw_input", None)
    model = snap.get("model_path") if isinstance(snap, dict) else getattr(server_args, "model_path", None)
    try:
        check_head_files(head_dir, target_config_of(model), sglang=True)
    except HeadMismatchError as e:
        raise JetFlowConfigError(f"--speculative-draft-model-path {head_dir} does not fit --model-path {model}: "
                                 f"{' '.join(str(e).split())}") from None
    except (CheckpointError, ValueError, OSError) as e:
        raise JetFlowConfigError(f"--speculative-draft-model-path {head_dir}: {' '.join(str(e).split())}") from None


def _config_hook(server_args, previous) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    if is_jetflow(resolving_view(server_args).speculative_algorithm):
        install_patches()
        resolve_config(server_args)
    previous(server_args)


def _backend_guard_hook(server_args, previous) -> None:
    from jetflow_sglang.sglang.attention.guard import BackendGuardError, guard_hook

    try:
        guard_hook(server_args, previous)
    except BackendGuardError as e:
        fail(e)


def _spec_class():
    from sglang.srt.speculative.spec_info import CustomSpecAlgo

    class JetFlowSpec(CustomSpecAlgo):
        def handle_server_args(self, sa) -> None:
            """`sa` records our writes as SGLang declarations (the operator's input stays on the record)."""
            cfg = resolve_config(sa)
            # The worker runs on SGLang's overlap scheduler; like SGLang's built-ins, synchronous on a CPU unless
            # JETFLOW_OVERLAP=on (config.py). --disable-overlap-schedule always gives the synchronous path.
            if not cfg.overlap:
                sa.disable_overlap_schedule = True
            # The radix cache stays on: the worker keeps the head's context K/V in a pool indexed by the target's KV
            # slots, so a prefix hit reuses it (worker.py / head_pool.py).
            # No dummy verify input exists for plugin algorithms, so no CUDA-graph capture of TARGET_VERIFY. The
            # runtime reads cuda_graph_config, which SGLang parsed from the legacy boolean before this step (as
            # arg_groups/model_hook.py says, flipping the boolean alone would not stop capture): both phases go off.
            sa.disable_cuda_graph = True
            graphs = sa.cuda_graph_config
            if graphs is not None:
                from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

                for phase in (Phase.DECODE, Phase.PREFILL):
                    graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
                sa.cuda_graph_config = graphs
            # SGLang reserves max(steps * topk, num_draft_tokens) KV slots per request and round and sizes its
            # verify buffers from them: declare the budget, and topk = steps = 1 (the tree's width and depth are
            # the worker's business; it reads them from the operator's raw flags through JetFlowServerConfig).
            sa.speculative_num_draft_tokens = cfg.budget
            sa.speculative_eagle_topk, sa.speculative_num_steps = 1, 1

        # SGLang 0.5.23's CustomSpecAlgo lacks these four; its scheduler calls them unconditionally.
        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def has_draft_kv(self) -> bool:
            return False  # the head keeps its context K/V itself; nothing of the draft lives in SGLang's pool

    return JetFlowSpec


def _worker_factory(server_args):
    from jetflow_sglang.sglang.worker import JetFlowWorker

    return JetFlowWorker


def _create_backend(runner):
    from jetflow_sglang.sglang.attention.tree_native import TreeTorchNativeAttnBackend

    return TreeTorchNativeAttnBackend(runner)


def _create_triton_backend(runner):
    from jetflow_sglang.sglang.attention.tree_triton import create

    return create(runner)


def _register_head_config() -> None:
    """SGLang reads --speculative-draft-model-path/config.json with transformers' AutoConfig while resolving its
    arguments; a JetFlow head folder says model_type "jetflow_head", so transformers must know that name."""
    from transformers import AutoConfig, PretrainedConfig

    class JetFlowHeadHFConfig(PretrainedConfig):
        model_type = "jetflow_head"

    try:
        AutoConfig.register("jetflow_head", JetFlowHeadHFConfig)
    except ValueError:  # already registered in this process
        pass


_RESOLUTION_HOOKS = []  # (name, fn) registered in this process


def _register_resolution_hooks() -> None:
    from sglang.srt.arg_groups import resolution_hooks

    from jetflow_sglang.sglang.attention.guard import HOOK as BACKEND_HOOK

    for name, fn in ((CONFIG_HOOK, _config_hook), (BACKEND_HOOK, _backend_guard_hook)):
        if (name, fn) not in _RESOLUTION_HOOKS:
            resolution_hooks.register_resolution_hook(name)(fn)
            _RESOLUTION_HOOKS.append((name, fn))


GUARD_ALL_ENV = "JETFLOW_GUARD_ALL"  # "1": the request guard in every SGLang server of this environment


def _spawned_for_jetflow() -> bool:
    """True in a process SGLang spawned for a JETFLOW server (scheduler, detokenizer, DP controller): the arguments
    multiprocessing started it with hold the server's ServerArgs."""
    import multiprocessing

    proc = multiprocessing.current_process()
    args = (*(getattr(proc, "_args", None) or ()), *(getattr(proc, "_kwargs", None) or {}).values())
    return any(is_jetflow(getattr(a, "speculative_algorithm", None)) for a in args)


_PATCHED = []


def install_patches() -> None:
    """Every run-time patch a JETFLOW server's processes need (compat.PATCHES), once per process. The worker adds
    its own round-time ones (worker.py) when it is built."""
    if _PATCHED:
        return
    from jetflow_sglang.sglang.fixes import memory, request_guard
    from jetflow_sglang.sglang.compat import check

    check()
    request_guard.install(launcher=_cli_launcher())
    memory.install()
    memory.install_row_headroom()
    _PATCHED.append(True)


def register() -> None:
    import os

    from jetflow_sglang.sglang.cpu import ops as cpu_ops  # the CPU harness: only with JETFLOW_SGLANG_CPU=1

    if cpu_ops.enabled():
        cpu_ops.install()
    _register_head_config()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from jetflow_sglang.sglang.attention.guard import TREE_NATIVE, TREE_TRITON  # names only: the backends' modules
    # (SGLang's torch_native backend, the KV pools, 1.7 s of imports) load in the processes that build a backend

    for name, factory in ((TREE_NATIVE, _create_backend), (TREE_TRITON, _create_triton_backend)):
        if name not in ATTENTION_BACKENDS:
            register_attention_backend(name)(factory)
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    try:  # register() runs once per process, but Engine + launcher may share one
        SpeculativeAlgorithm.from_string(ALGORITHM)
    except ValueError:
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_spec_class())(_worker_factory)
    _register_resolution_hooks()
    if _spawned_for_jetflow():
        install_patches()
    elif os.environ.get(GUARD_ALL_ENV) == "1":
        from jetflow_sglang.sglang.fixes import request_guard

        request_guard.install(launcher=_cli_launcher())
