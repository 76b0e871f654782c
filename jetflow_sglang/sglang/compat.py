"""Import-time guard: the SGLang names the JETFLOW plugin relies on. SGLang's plugin API is young (the custom
algorithm registry landed in 0.5.x and still misses methods), so a different release fails here, with the
pinned version named, instead of deep inside the scheduler."""
from __future__ import annotations

import importlib
import types

SGLANG_VERSION = "0.5.23"

NAMES = {
    "sglang.srt.speculative.spec_info": ["SpeculativeAlgorithm", "SpecInputType", "CustomSpecAlgo"],
    "sglang.srt.runtime_context": ["get_spec"],
    "sglang.srt.model_executor.cuda_graph_config": ["Backend", "Phase", "with_phase"],
    "sglang.srt.speculative.base_spec_worker": ["BaseSpecWorker"],
    "sglang.srt.speculative.ngram_info": ["NgramVerifyInput"],
    "sglang.srt.speculative.spec_utils": ["move_accept_tokens_to_target_kvcache"],
    "sglang.kernels.ops.speculative.cache_locs": ["assign_extend_cache_locs_func"],
    "sglang.srt.managers.utils": ["GenerationBatchResult"],
    "sglang.srt.managers.overlap_utils": ["FutureMap"],
    "sglang.srt.model_executor.forward_batch_info": ["ForwardMode", "CaptureHiddenMode"],
    "sglang.srt.layers.attention.attention_registry": ["ATTENTION_BACKENDS", "register_attention_backend"],
    "sglang.srt.layers.attention.torch_native_backend": ["TorchNativeAttnBackend"],
    "sglang.srt.mem_cache.memory_pool": ["KVWriteLoc"],
    "sglang.srt.arg_groups.choices": ["add_attention_backend_choices", "ATTENTION_BACKEND_CHOICES"],
    "sglang.srt.arg_groups.overrides": ["resolving_view", "declare_resolution", "attention_backends_of"],
    "sglang.srt.arg_groups.resolution_hooks": ["register_resolution_hook"],
    "sglang.srt.layers.dp_attention": ["get_dp_tp_group"],
}
# attributes of classes/objects used by the worker
ATTRS = {
    ("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm"): ["register", "from_string"],
    ("sglang.srt.speculative.spec_info", "CustomSpecAlgo"): ["handle_server_args", "create_worker"],
    ("sglang.srt.model_executor.forward_batch_info", "ForwardMode"): ["TARGET_VERIFY", "DECODE"],
    ("sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode"): ["FULL"],
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager"): ["_validate_one_request"],
}


# Every SGLang function or object the plugin changes at run time, in one list (no SGLang file on disk is modified;
# everything else goes through SGLang's own plugin API: the algorithm registry, register_attention_backend, resolution
# hooks). (dotted target, the module that wraps it, why). check() verifies each target exists in the installed SGLang,
# and docs/UPSTREAM.md names, for each, the SGLang change that would retire it. Four groups:
# - SERVING: fixes of SGLang that a JETFLOW server needs, installed only in its own processes (plugin.install_patches
#   and the worker);
# - CPU_HARNESS: what lets SGLang serve on a machine without a GPU (JETFLOW_SGLANG_CPU=1, or a CPU target);
# - BENCHMARK: SGLang's DFLASH as a CPU peer for the benchmark, never installed by the plugin;
# - DIAGNOSTIC: the host-sync counter's swaps of two torch methods, with JETFLOW_COUNT_SYNCS=1, during a round.
SERVING = [
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "fixes/request_guard.py",
     "empty prompts, out-of-vocabulary ids and unbounded sampling or logprob "
     "values get a 400 instead of ending the scheduler"),
    ("sglang.srt.entrypoints.http_server.write_data_for_multi_tokenizer", "fixes/request_guard.py",
     "--tokenizer-worker-num > 1: the launcher hands scheduler_info to SGLang's tokenizer workers as a dict whose "
     "unpickling loads the plugins there first (SGLang 0.5.23 does not), so JETFLOW's name and the request guard "
     "reach every worker"),
    ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative",
     "worker.py", "/server_info gains the worker's per-step state and avg_spec_accept_length from the first round"),
    ("sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch", "fixes/penalties.py",
     "overlap scheduler only: a JETFLOW decode batch with history-dependent penalties or a custom logit processor "
     "runs after the previous round is processed, so they see every output token (SGLang does the same for grammar "
     "batches)"),
    ("sglang.srt.sampling.penaltylib.orchestrator._BatchedPenalizer.prepare", "fixes/penalties.py",
     "a request that prefills again after SGLang retracted it starts its penalizers with its output so far (SGLang's "
     "start from zero), so the token sampled at that prefill keeps its penalties and min_new_tokens progress"),
    ("sglang.srt.session.streaming_session.StreamingSession.try_cache_finished_req", "fixes/sessions.py",
     "--enable-streaming-session: a finished turn's KV record ends before its last output token, whose slot holds a "
     "draft node's KV (the next turn computes it, as after plain decoding)"),
    ("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__", "fixes/memory.py",
     "the per-token KV cell size counts the head's K/V and token-id rows, so the pool fits the memory budget"),
    ("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", "fixes/memory.py",
     "JETFLOW servers: each request's req_to_token row holds the whole decode reservation (twice the draft tokens) "
     "past the context length, so a request that runs to its context length stays inside its row"),
    ("sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len", "fixes/memory.py",
     "the same function, where the pool builder imported it by name"),
    ("sglang.srt.runtime_context.get_spec", "worker.py",
     "speculative_num_draft_tokens is lowered at run time near a full KV pool (the decode reservation reads it and "
     "the derived max_speculative_num_draft_tokens, which SGLang's public RuntimeContext.override refuses)"),
]

CPU_HARNESS = [
    ("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head", "cpu/gemm.py",
     "CPU only, per model instance: multi-row LM-head products as W @ X^T (rowgemm)"),
    ("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod", "cpu/gemm.py",
     "CPU only: the target's unquantized linear layers switch to a subclass that runs rowgemm"),
    ("sglang.srt.mem_cache.allocation.get_last_loc", "cpu/paging.py",
     "CPU target only: with --page-size > 1 the speculative KV reservation looks up each request's last slot in "
     "torch (SGLang's own get_last_loc_torch) instead of a Triton kernel, which a CPU cannot run"),
    ("sgl_kernel", "cpu/ops.py",
     "CPU only (JETFLOW_SGLANG_CPU=1): a pure-torch stand-in module for the CUDA-only kernels, and a torchvision stub"),
]

# -- benchmark only ------------------------------------------------------------------------------------------------
# SGLang's own DFLASH as a CPU peer of JETFLOW (scripts/bench_serving.py's dflash-bN configs and
# tests/sglang/test_dflash_peer.py). Active only in a server launched with JETFLOW_SGLANG_CPU=1 and
# JETFLOW_BENCH_DFLASH_PEER=1 (cpu/boot.py reads the switch once); the plugin itself never installs them. Besides
# these, cpu/dflash_peer.py registers the `dflash_peer_native` draft attention backend through SGLang's public
# register_attention_backend / add_attention_backend_choices / add_draft_attention_backend_choices.
BENCHMARK = [
    ("sglang.srt.arg_groups.speculative_hook._handle_dflash", "cpu/dflash_peer.py",
     "benchmark only, --device cpu: an AROUND hook runs SGLang's DFLASH checks against a platform view that accepts "
     "DFLASH on the CPU (the stock gate allows cuda, npu and xpu alone) and offers `dflash_peer_native` as the only "
     "draft attention backend (stock torch_native cannot run the draft's TARGET_VERIFY forward; jetflow_tree_native "
     "would run DFLASH's bidirectional draft layers causally)"),
    ("sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs", "cpu/dflash_peer.py",
     "benchmark only: the DFLASH draft's input embeddings keep the model's dtype (SGLang casts them to bfloat16 "
     "unconditionally, which breaks a float32 server)"),
    ("torch.Tensor.record_stream", "cpu/dflash_peer.py",
     "benchmark only: a no-op for CPU tensors (DFLASH records the batch's seq_lens on the current stream; a CPU "
     "tensor has none and torch raises 'unknown parameter type')"),
    ("sglang.srt.models.dflash.DFlashAttention.__init__", "cpu/dflash_peer.py",
     "benchmark only: the DFLASH draft's bfloat16 layers take SGLang's torch q/k-norm + RoPE path, not its fused "
     "Triton kernel, which has no CPU driver"),
]


# -- diagnostic only ----------------------------------------------------------------------------------------------
# The host-sync counter (JETFLOW_COUNT_SYNCS=1, host_syncs.py): while one decode round runs, two torch.Tensor methods
# that read device values on the host without reaching torch's dispatcher when the tensor is on the CPU are swapped
# for counting twins, and put back when the round ends. Off by default; no SGLang function changes.
DIAGNOSTIC = [
    ("torch.Tensor.tolist", "host_syncs.py", "JETFLOW_COUNT_SYNCS=1, during a round only: counted (a host read)"),
    ("torch.Tensor.cpu", "host_syncs.py", "JETFLOW_COUNT_SYNCS=1, during a round only: counted (a host read)"),
]


PATCHES = SERVING + CPU_HARNESS + BENCHMARK + DIAGNOSTIC


WRAPPED = "_jetflow"  # set on every wrapper `wrap` installs


def _dotted(owner) -> str:
    """A module's name, or a class's (an instance's class's) module-qualified name."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}"


def wrap(owner, name: str, make) -> bool:
    """Replace `owner.name` (a module's function, a class's method, or one instance's) by `make(original)`, once per
    owner and process; False when it is wrapped already. Every target must be listed in PATCHES, so no run-time
    change of SGLang (or torch) escapes that list."""
    original = getattr(owner, name)
    if getattr(original, WRAPPED, False):
        return False
    target = f"{_dotted(owner)}.{name}"
    if target not in {t for t, _, _ in PATCHES}:
        raise RuntimeError(f"{target} is wrapped at run time but not listed in jetflow_sglang.sglang.compat.PATCHES")
    new = make(original)
    setattr(new, WRAPPED, True)
    setattr(owner, name, new)
    return True


def _resolves(dotted: str) -> bool:
    """True when `dotted` names an importable module or an attribute chain under one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


class SGLangVersionError(ImportError):
    pass


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check() -> None:
    """Raise SGLangVersionError naming sglang==0.5.23 when any name the plugin uses is missing."""
    have = installed_version()
    if have is None:
        raise SGLangVersionError(f"the JETFLOW SGLang plugin needs sglang=={SGLANG_VERSION}, which is not installed "
                                 "(CPU: bash scripts/install_sglang_cpu.sh; GPU: pip install 'jetflow-sglang[sglang]')")
    missing = []
    for mod_name, names in NAMES.items():
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            if "sgl_kernel" in str(e) or "libcuda" in str(e):
                raise SGLangVersionError(f"SGLang cannot load its kernels here ({e}); on a CPU machine set "
                                         "JETFLOW_SGLANG_CPU=1") from e
            missing.append(f"{mod_name} ({e})")
            continue
        missing += [f"{mod_name}.{n}" for n in names if not hasattr(mod, n)]
    for (mod_name, obj), attrs in ATTRS.items():
        target = getattr(importlib.import_module(mod_name), obj, None)
        missing += [f"{mod_name}.{obj}.{a}" for a in attrs if target is not None and not hasattr(target, a)]
    missing += [f"{target} (wrapped by {where})" for target, where, _ in PATCHES if not _resolves(target)]
    if missing:
        raise SGLangVersionError(f"the JETFLOW SGLang plugin is written for sglang=={SGLANG_VERSION} but sglang=={have} "
                                 f"lacks: {', '.join(missing)}. Install sglang=={SGLANG_VERSION}.")
