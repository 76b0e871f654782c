"""SGLang plugin entry point (group `sglang.srt.plugins`, see pyproject.toml). SGLang calls `register()` in every
process it starts (launcher, engine, scheduler, detokenizer), before it resolves the server arguments:

    python -m sglang.launch_server --model-path M --speculative-algorithm JETFLOW \
        --speculative-draft-model-path HEAD_DIR --device cpu ...

It registers, without patching any SGLang file:
  - the JETFLOW algorithm (worker: jetflow_sglang.sglang.worker.JetFlowWorker);
  - the tree-verify attention backend `jetflow_tree_native` (SDPA; CPU default);
  - two resolution-step wrappers: the config check (before `handle_speculative_decoding`, so a bad JETFLOW
    setting, a missing head folder or a head whose files do not fit the target (check_head) fails with one line
    before SGLang looks the head up on the hub or loads the target) and the attention-backend guard
    (backend_guard.py);
  - the request guard (request_guard.py): empty prompts and out-of-vocabulary token ids get a 400.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from jetflow_sglang.sglang.config import ALGORITHM, is_jetflow
from jetflow_sglang.sglang.cpu import ops as cpu_ops

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
        resolve_config(server_args)
    previous(server_args)


def _backend_guard_hook(server_args, previous) -> None:
    from jetflow_sglang.sglang.backend_guard import BackendGuardError, guard_hook

    try:
        guard_hook(server_args, previous)
    except BackendGuardError as e:
        fail(e)


def _spec_class():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

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
            # No dummy verify input exists for plugin algorithms, so no CUDA-graph capture of TARGET_VERIFY.
            sa.disable_cuda_graph = True
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
    from jetflow_sglang.sglang.attention_backend import TreeTorchNativeAttnBackend

    return TreeTorchNativeAttnBackend(runner)


def _create_triton_backend(runner):
    from jetflow_sglang.sglang.triton_backend import create

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


def _register_resolution_hooks() -> None:
    from sglang.srt.arg_groups import resolution_hooks

    from jetflow_sglang.sglang.backend_guard import HOOK as BACKEND_HOOK

    for name, fn in ((CONFIG_HOOK, _config_hook), (BACKEND_HOOK, _backend_guard_hook)):
        if fn not in resolution_hooks._HOOKS.get(name, []):
            resolution_hooks.register_resolution_hook(name)(fn)


def register() -> None:
    if cpu_ops.enabled():
        cpu_ops.install()
    from jetflow_sglang.sglang.compat import check

    check()
    _register_head_config()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from jetflow_sglang.sglang.attention_backend import NAME
    from jetflow_sglang.sglang.request_guard import install as install_request_guard
    from jetflow_sglang.sglang.triton_backend import NAME as TRITON_NAME

    for name, factory in ((NAME, _create_backend), (TRITON_NAME, _create_triton_backend)):
        if name not in ATTENTION_BACKENDS:
            register_attention_backend(name)(factory)
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    if get_spec(ALGORITHM) is None:  # register() runs once per process, but Engine + launcher may share one
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_spec_class())(_worker_factory)
    _register_resolution_hooks()
    install_request_guard()
    from jetflow_sglang.sglang.memory import install as install_pool_sizing, install_row_headroom

    install_pool_sizing()
    install_row_headroom()
