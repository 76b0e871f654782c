"""Every verified node's logits through plain SGLang's chain, in its order, before acceptance and logprobs.

Plain SGLang processes a decode step's logits as: penalties, the grammar's vocabulary mask, `logit_bias`
(SamplingBatchInfo.apply_logits_bias), then the requests' custom logit processors (Sampler._preprocess_logits). It
samples from the result and returns logprobs of the result. JETFLOW runs the same steps on each tree node as if the
node's path had been decoded:
- penalties count the request's output plus the path's tokens (fixes/penalties.py);
- the grammar walks the path (SGLang's GrammarTree and build_grammar_vocab_mask, as EAGLE does);
- `logit_bias` is added to every node;
- a custom logit processor sees, in `custom_params["__req__"]`, the request with the path appended to its
  `output_ids`, so processors that read the history (SGLang's thinking-budget ones) decide as plain decoding would.
  SGLang's own speculative workers pass the committed request to every node, which is exact only for processors that
  ignore the history. The tree goes to the host for this (one copy per round, in these batches only), and on the
  overlap scheduler such a batch runs after the previous round is processed (penalties.install_sync_fallback), so
  `output_ids` hold every token.
The worker accepts on the processed logits and hands them to SGLang's logprob computation: greedy output, sampling
and returned logprobs are those of plain decoding.
"""
from __future__ import annotations

import copy

import torch

from jetflow_sglang.core.tree_batch import TreeBatch
from jetflow_sglang.sglang.fixes.penalties import penalise


class _NodeReq:
    """A request as a custom logit processor sees it at a tree node: its output so far, then the node's path."""

    def __init__(self, req, path: list[int]):
        self._req = req
        self.output_ids = copy.copy(req.output_ids)  # SGLang keeps an array('q'); processors may add it to another
        self.output_ids.extend(path)

    def __getattr__(self, name):
        return getattr(self._req, name)


def _at_node(params, req, path: list[int]):
    if not isinstance(params, dict) or "__req__" not in params or not path:
        return params
    return {**params, "__req__": _NodeReq(req, path)}


def custom_processors(logits: torch.Tensor, batch, tree: TreeBatch) -> torch.Tensor:
    """Apply each request's custom logit processor to its nodes' rows of `logits` [b*n, V] (in place). Padding rows
    (never accepted) get the committed request."""
    info = batch.sampling_info
    n = tree.tokens.shape[1]
    trees = tree.trees()  # host copies
    for entry in info.custom_logit_processor.values():
        rows, params = [], []
        for i in entry.rows:
            t = trees[i]
            for j in range(n):
                path = [t.tokens[k] for k in t.path_to(j)[1:]] if j < len(t) else []  # the root is already output
                rows.append(i * n + j)
                params.append(_at_node(info.custom_params[i], batch.reqs[i], path))
        index = torch.tensor(rows, device=logits.device)
        result = entry.processor(logits.index_select(0, index), params)
        logits.index_copy_(0, index, result.to(logits.dtype))
    return logits


def grammar_mask(logits: torch.Tensor, batch, tree: TreeBatch, links) -> torch.Tensor:
    """Mask each node with its request's grammar advanced along the node's path (a copy of `logits`)."""
    from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

    r_next, r_sib = links
    gtree = GrammarTree.from_host(r_next.cpu(), r_sib.cpu(), tree.tokens.cpu())
    mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=gtree, sampling_info=batch.sampling_info,
                                    device=logits.device, barrier=None)
    if mask is not None:
        logits = logits.clone()
        mask.apply(logits)
    return logits


def process(logits: torch.Tensor, batch, tree: TreeBatch, links) -> torch.Tensor:
    """logits [b*n, V] of the verified nodes -> processed logits (`logits` itself when nothing applies).
    links: (retrieve_next_token, retrieve_next_sibling) of the verify input, for the grammar."""
    info = batch.sampling_info
    logits = penalise(logits, batch, tree)
    if batch.has_grammar:
        logits = grammar_mask(logits, batch, tree, links)
    if info.logit_bias is not None:
        logits = logits + info.logit_bias.repeat_interleave(tree.tokens.shape[1], 0).to(logits.dtype)
    if getattr(info, "has_custom_logit_processor", False):
        logits = custom_processors(logits, batch, tree)  # in place, as plain SGLang's sampler
    return logits
