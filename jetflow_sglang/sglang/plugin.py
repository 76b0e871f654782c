"""SGLang plugin entry point (group `sglang.srt.plugins`, see pyproject.toml). SGLang calls `register()` in every
process it starts (launcher, engine, scheduler, detokenizer), before it resolves the server arguments:

    python -m sglang.launch_server --model-path M --speculative-algorithm JETFLOW \
        --speculative-draft-model-path HEAD_DIR --device cpu ...

It registers the JETFLOW algorithm (worker: jetflow_sglang.sglang.worker.JetFlowWorker) and the CPU tree-verify
attention backend `jetflow_tree_native`. Nothing in SGLang's own files is patched.
"""
from __future__ import annotations

import logging
import os

from . import cpu_ops

logger = logging.getLogger(__name__)
ALGORITHM = "JETFLOW"
DEFAULT_BUDGET = 8  # draft-tree nodes per request and round (root included) when --speculative-num-draft-tokens is unset


def _spec_class():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class JetFlowSpec(CustomSpecAlgo):
        def handle_server_args(self, sa) -> None:
            # The worker is synchronous (V2 schema, overlap off); SGLang only turns overlap off for its built-ins.
            sa.disable_overlap_schedule = True
            # The head needs the target's hidden states for every committed token; a radix-cache hit would skip
            # the prefill rows that produce them.
            sa.disable_radix_cache = True
            # No dummy verify input exists for plugin algorithms, so no CUDA-graph capture of TARGET_VERIFY.
            sa.disable_cuda_graph = True
            if sa.speculative_num_draft_tokens is None:
                sa.speculative_num_draft_tokens = int(os.environ.get("JETFLOW_BUDGET", DEFAULT_BUDGET))
            # SGLang's own knobs map onto the tree shape (the worker reads the env in the scheduler process);
            # SGLang itself keeps steps=topk=1 so that it reserves only `num_draft_tokens` KV slots per round.
            if sa.speculative_eagle_topk not in (None, 1):
                os.environ["JETFLOW_WIDTH"] = str(sa.speculative_eagle_topk)
            if sa.speculative_num_steps not in (None, 1):
                os.environ["JETFLOW_DEPTH"] = str(sa.speculative_num_steps)
            sa.speculative_eagle_topk, sa.speculative_num_steps = 1, 1
            if sa.device == "cpu" and sa.attention_backend in (None, "torch_native"):
                from .attention_backend import NAME

                sa.attention_backend = NAME

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
    from .worker import JetFlowWorker

    return JetFlowWorker


def _create_backend(runner):
    from .attention_backend import TreeTorchNativeAttnBackend

    return TreeTorchNativeAttnBackend(runner)


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


def register() -> None:
    if cpu_ops.enabled():
        cpu_ops.install()
    from .compat import check

    check()
    _register_head_config()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from .attention_backend import NAME

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(_create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if get_spec(ALGORITHM) is None:  # register() runs once per process, but Engine + launcher may share one
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=False, spec_class=_spec_class())(_worker_factory)
