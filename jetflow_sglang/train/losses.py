"""Per-slot distillation losses over the (reduced) draft vocabulary.

All take student logits [N, V] and teacher log-probs [N, V] (already renormalised over the draft vocab) and return a
per-slot loss [N]; `weighted_mean` applies the optional DFlash depth weighting. Temperature 1, as in the paper.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("fkl", "rkl", "sft")


def forward_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(p_target || q_head): mass-covering, the paper's default. d/dz = q - p."""
    q = F.log_softmax(student_logits.float(), -1)
    p = teacher_logp.float()
    return (p.exp() * (p - q)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(q_head || p_target): mode-seeking. Teacher zeros are clamped so an out-of-support draft stays finite."""
    q = F.log_softmax(student_logits.float(), -1)
    p = teacher_logp.float().clamp(min=-1e4)
    return (q.exp() * (q - p)).sum(-1)


def sft(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hard-label cross-entropy on the token the target actually wrote (labels index the draft vocab)."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


def slot_loss(kind: str, student_logits, teacher_logp, labels) -> torch.Tensor:
    if kind == "fkl":
        return forward_kl(student_logits, teacher_logp)
    if kind == "rkl":
        return reverse_kl(student_logits, teacher_logp)
    if kind == "sft":
        return sft(student_logits, labels)
    raise ValueError(f"unknown loss {kind!r}; choose from {LOSSES}")


def depth_weights(depth: torch.Tensor, gamma: float) -> torch.Tensor:
    """DFlash decay w = exp(-(depth-1)/gamma); gamma <= 0 gives uniform weights (the paper's JetSpec default)."""
    if gamma <= 0:
        return torch.ones_like(depth, dtype=torch.float32)
    return torch.exp(-(depth.float() - 1) / gamma)


def weighted_mean(loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (loss * weights).sum() / weights.sum().clamp(min=1e-8)
