"""Batched tree verification on the HF target: b requests with ragged committed lengths in one padded KV cache.

Request i's committed rows are [0, lens[i]) of every layer's cache; rows past that are stale and masked out. A verify
step appends the b padded trees (N slots each) after the longest prefix, runs one forward with a float tree mask per
request, then moves every request's accepted rows down to its own prefix end.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from jetflow_sglang.engine.target import Target
from jetflow_sglang.core.tree_batch import TreeBatch


class BatchTarget:
    def __init__(self, target: Target):
        self.target = target
        self.model = target.model
        self.cache: DynamicCache | None = None
        self.lens: list[int] = []
        self._tree_start = 0

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def physical(self) -> int:
        return self.cache.layers[0].keys.shape[-2]

    def _taps(self, hidden_states, rows=slice(None)) -> torch.Tensor:
        return torch.cat([hidden_states[l + 1][rows] for l in self.target.tap_layers], -1)

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One batch-1 prefill per prompt (the same numerics as Target.prefill), stacked into a padded cache.
        Returns the last logits [b, V] (float) and each prompt's taps [P_i, n_taps * H]."""
        for p in prompts:
            self.target.check_prompt(p)
        per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        last, taps = [], []
        for p in prompts:
            cache = DynamicCache(config=self.target.config)
            ids = torch.as_tensor(list(p), dtype=torch.long, device=self.device)[None]
            out = self.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=self.device)[None],
                             past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
            last.append(out.logits[0, -1].float())
            taps.append(self._taps(out.hidden_states, 0))
            per_layer.append([(layer.keys, layer.values) for layer in cache.layers])
        self.lens = [len(p) for p in prompts]
        width = max(self.lens)
        data = []
        for layer in range(len(per_layer[0])):
            ks = [torch.nn.functional.pad(kv[layer][0], (0, 0, 0, width - kv[layer][0].shape[-2])) for kv in per_layer]
            vs = [torch.nn.functional.pad(kv[layer][1], (0, 0, 0, width - kv[layer][1].shape[-2])) for kv in per_layer]
            data.append((torch.cat(ks), torch.cat(vs)))
        self.cache = DynamicCache(config=self.target.config)
        for layer, (k, v) in enumerate(data):
            self.cache.update(k, v, layer)
        return torch.stack(last), taps

    @torch.no_grad()
    def verify(self, tb: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """All b trees in one forward. Returns logits [b, N, V] (float) and taps [b, N, n_taps * H]."""
        b, n = tb.tokens.shape
        if b != len(self.lens):
            raise ValueError(f"{b} trees for {len(self.lens)} requests")
        dev, dtype, prefix = self.device, self.target.dtype, self.physical
        self._tree_start = prefix
        lens = torch.tensor(self.lens, dtype=torch.long, device=dev)
        allow = torch.cat([(torch.arange(prefix, device=dev)[None] < lens[:, None])[:, None].expand(b, n, prefix),
                           tb.ancestor_mask().to(dev)], 2)
        mask = torch.zeros(allow.shape, dtype=dtype, device=dev).masked_fill(~allow, torch.finfo(dtype).min)
        out = self.model(input_ids=tb.tokens.to(dev), position_ids=lens[:, None] + tb.depths.to(dev),
                         attention_mask=mask[:, None], past_key_values=self.cache, use_cache=True,
                         output_hidden_states=True)
        return out.logits.float(), self._taps(out.hidden_states)

    @torch.no_grad()
    def commit(self, accept_index: torch.Tensor, accept_len: Sequence[int]) -> None:
        """accept_index [b, A] (tree node ids, root first, -1 padded) and accepted counts: keep those rows."""
        b, a = accept_index.shape
        dev = self.device
        src = self._tree_start + accept_index.to(dev).clamp(min=0)  # [b, A]; -1 slots copy the root, never read
        dst = torch.tensor(self.lens, dtype=torch.long, device=dev)[:, None] + torch.arange(a, device=dev)
        new_lens = [n + int(c) for n, c in zip(self.lens, accept_len)]
        end = max(new_lens)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                shape = (b, t.shape[1], a, t.shape[3])
                rows = t.gather(2, src[:, None, :, None].expand(shape))  # gathered first: sources may overlap targets
                t.scatter_(2, dst[:, None, :, None].expand(shape), rows)
                setattr(layer, name, t[..., :end, :])
        self.lens = new_lens

    def keep(self, rows: Sequence[int]) -> None:
        """Drop finished requests: keep `rows` (in that order)."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
        self.lens = [self.lens[i] for i in rows]
