"""What a JetFlow head needs from SGLang's target model, under any tensor-parallel size.

A head shares the target's token embedding and LM head (jetflow_sglang.head: `bind(target)` keeps
`target.get_input_embeddings()` as a callable and reads `target.get_output_embeddings().weight`). In SGLang both are
vocab-parallel: under `--tp N` each rank holds 1/N of the (padded) vocabulary rows. So:

  embedding  the target's own `embed_tokens` forward (VocabParallelEmbedding: masked local lookup, then an
             all-reduce over the TP group). Under TP this is a collective: every rank must run the head's embedding
             calls in the same order with the same shapes (jetflow_sglang.sglang.tp_sync has the rank-0 helpers).
  LM head    the full [vocab, hidden] weight: a view of the real rows at tp=1 (no copy); under TP the shards are
             gathered once at load time (vocab x hidden extra memory per rank), in SGLang's shard order.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class TargetViewError(ValueError):
    """The SGLang model cannot lend a head its embedding or LM head; one line naming what is missing."""


class _Embedding(torch.nn.Module):
    """Calls the target's embedding forward on real token ids; `weight` is the local shard (for dtype/device)."""

    def __init__(self, embed_tokens: torch.nn.Module, vocab_size: int):
        super().__init__()
        self._embed = [embed_tokens]  # a list, so the target's module is not registered as our submodule
        self.vocab_size = vocab_size

    @property
    def weight(self) -> torch.Tensor:
        return self._embed[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = ids.shape
        out = self._embed[0](ids.reshape(-1))
        return out.reshape(*shape, out.shape[-1])


class _LMHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _inner_model(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise TargetViewError(f"{type(model).__name__} has no model.embed_tokens; JETFLOW heads need a "
                              "Llama/Qwen2/Qwen3-style target")
    return inner


def full_lm_weight(lm_head, vocab_size: int) -> torch.Tensor:
    """[vocab_size, hidden]: the LM head rows for every real token id, gathered over the TP group if sharded."""
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TargetViewError(f"the target's LM head ({type(lm_head).__name__}) has no plain 2-D weight "
                              "(quantized LM heads are not supported by JETFLOW)")
    tp_size = int(getattr(lm_head, "tp_size", 1) or 1)
    if tp_size == 1:
        if weight.shape[0] < vocab_size:
            raise TargetViewError(f"LM head has {weight.shape[0]} rows for a vocabulary of {vocab_size}")
        return weight[:vocab_size]  # SGLang pads the vocabulary; a view of the real rows shares its memory
    org, num = getattr(lm_head, "org_vocab_size", vocab_size), getattr(lm_head, "num_embeddings", vocab_size)
    if num != org:
        raise TargetViewError("JETFLOW under tensor parallelism does not support an LM head with added (LoRA) "
                              "vocabulary rows")
    group = getattr(lm_head, "tp_group", None)
    if group is None:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    if int(group.world_size) != tp_size:
        raise TargetViewError(f"LM head is split {tp_size} ways but its group has {group.world_size} ranks")
    full = group.all_gather(weight.detach().contiguous(), dim=0)  # shards are consecutive padded vocab ranges
    if full.shape[0] < vocab_size:
        raise TargetViewError(f"gathered LM head has {full.shape[0]} rows for a vocabulary of {vocab_size}")
    logger.info("JETFLOW: gathered the LM head over %d TP ranks (%d x %d)", tp_size, vocab_size, full.shape[1])
    return full[:vocab_size].contiguous()


class TargetView:
    """The target as `load_head(dir, target)` sees it: `.config` (the HF config), `get_input_embeddings()`,
    `get_output_embeddings().weight` and `parameters()` (dtype and device)."""

    def __init__(self, model, hf_config):
        self.config = hf_config
        self._model = model
        vocab = int(hf_config.vocab_size)
        inner = _inner_model(model)
        self._emb = _Embedding(inner.embed_tokens, vocab)
        lm_head = getattr(model, "lm_head", None)
        if lm_head is None:
            raise TargetViewError(f"{type(model).__name__} has no lm_head")
        self._lm = _LMHead(full_lm_weight(lm_head, vocab))

    def get_input_embeddings(self):
        return self._emb

    def get_output_embeddings(self):
        return self._lm

    def parameters(self):
        return self._model.parameters()


def _set_dflash_layers_to_capture(self, layer_ids):
    """SGLang's Qwen3/Llama method, for model classes that have the capture machinery but not the method (Qwen2 in
    0.5.23): capture "before layer l+1", i.e. the output of decoder layer l (HF hidden_states[l+1])."""
    if not self.pp_group.is_last_rank:
        return
    if layer_ids is None:
        raise ValueError("JETFLOW needs explicit tap layer ids for hidden-state capture")
    self.capture_aux_hidden_states = True
    self.model.layers_to_capture = [int(v) + 1 for v in layer_ids]


def ensure_tap_capture(model) -> bool:
    """Give the model's class `set_dflash_layers_to_capture` when its forward already captures aux hidden states
    (`model.layers_to_capture` + `capture_aux_hidden_states`, as SGLang's Qwen2ForCausalLM) but the method is missing.
    Patches the class in memory only. Returns whether the model can capture tap layers."""
    if hasattr(model, "set_dflash_layers_to_capture"):
        return True
    inner = getattr(model, "model", None)
    if not (hasattr(model, "capture_aux_hidden_states") and hasattr(inner, "layers_to_capture")
            and hasattr(model, "pp_group")):
        return False
    type(model).set_dflash_layers_to_capture = _set_dflash_layers_to_capture
    logger.info("JETFLOW: added set_dflash_layers_to_capture to %s", type(model).__name__)
    return True


def load_head_for_runner(model_runner, head_dir):
    """Load the draft head in `head_dir` for SGLang's target (`model_runner.model`), on the runner's device and in
    the target's dtype, bound to the target's embedding and LM head through a TargetView. Also makes sure the
    target can capture the head's tap layers (ensure_tap_capture)."""
    from jetflow_sglang.head import load_head

    ensure_tap_capture(model_runner.model)
    view = TargetView(model_runner.model, model_runner.model_config.hf_config)
    return load_head(head_dir, view, device=model_runner.device)
