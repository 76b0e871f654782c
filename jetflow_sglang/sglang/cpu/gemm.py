"""JETFLOW on a CPU server: the target's multi-row products as W @ X^T (jetflow_sglang.core.rowgemm).

A TARGET_VERIFY forward multiplies every weight by batch x tree-size rows; stock `F.linear` / `matmul(h, W.T)` cost
1.7-3x a one-row product there on CPU, the transposed product about one weight read (bench/results/rowgemm.md).
`install(model, extra)` switches the target's unquantized linear layers (their quant method) and its LM head (the
logits processor's plain-weight branch) to it, and measures per weight shape (the target's and the draft head's,
`extra`) up to how many rows it beats F.linear on this machine (machine.tune_rowgemm, cached in the user cache): each
product takes W @ X^T only there. The worker calls it only for a CPU target, so a server without JETFLOW, and every GPU
server, runs SGLang's own kernels; AMX-packed layers, quantized and LoRA heads keep theirs.
"""
from __future__ import annotations

import logging

from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils.common import use_intel_amx_backend

from jetflow_sglang.core import rowgemm
from jetflow_sglang.sglang.compat import wrap
from jetflow_sglang.machine import tune_rowgemm

logger = logging.getLogger(__name__)


class RowGemmLinearMethod(UnquantizedLinearMethod):
    """UnquantizedLinearMethod whose apply runs rowgemm.linear (the instance keeps its state and isinstance)."""

    def apply(self, layer, x, bias=None):
        if use_intel_amx_backend(layer) or x.device.type != "cpu":
            return super().apply(layer, x, bias)
        return rowgemm.linear(x, layer.weight, bias, contiguous=True)  # SGLang's CPU ops assume row-major


def _wrap_lm_head(processor) -> bool:
    def make(original):
        def _compute_lm_head(hidden_states, lm_head, embedding_bias=None, *, out=None):
            w = getattr(lm_head, "weight", None)
            plain = (w is not None and embedding_bias is None and hidden_states.device.type == "cpu"
                     and w.dtype == hidden_states.dtype and w.dtype.is_floating_point and w.dim() == 2
                     and not hasattr(lm_head, "set_lora")
                     and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
                     and not processor.use_fp32_lm_head and not use_intel_amx_backend(lm_head)
                     and processor.rl_on_policy_target is None)
            if not plain:
                return original(hidden_states, lm_head, embedding_bias, out=out)
            return rowgemm.linear(hidden_states, w, contiguous=True)  # grammar masks write logits in place
        return _compute_lm_head

    return wrap(processor, "_compute_lm_head", make)


def install(model, extra=()) -> int:
    """Switch the model's plain linears and LM head to rowgemm and measure where it pays for their weights' shapes
    and `extra` weights; returns how many layers changed (idempotent)."""
    n = 0
    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        if type(qm) is UnquantizedLinearMethod:
            qm.__class__ = RowGemmLinearMethod
            n += 1
    processor = getattr(model, "logits_processor", None)
    if processor is not None and hasattr(processor, "_compute_lm_head"):
        n += _wrap_lm_head(processor)
    weights = [p for p in model.parameters() if p.dim() == 2] + list(extra)
    limits = tune_rowgemm(weights)
    logger.info("JETFLOW: %d CPU linear layers; W @ X^T where it measured faster, rows per weight shape: %s", n,
                ", ".join(f"{a}x{b}: {r}" for (a, b), r in sorted(limits.items())) or "none (not float32)")
    return n
