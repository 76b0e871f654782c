"""Teacher features: one teacher-forced target forward per regenerated sequence, cached once in bf16.

Per sequence we keep
  taps  [T, n_taps*H]  HF hidden_states[l+1] for l in tap_layers (exactly what `Target` feeds the head at inference)
  final [T, H]         the output of the target's final norm, so teacher logits = final @ E^T can be recomputed over
                       the draft vocabulary at training time (storing 49k-wide logits would be 85x bigger).
The cache is written in shards and resumes by record key.
"""
from __future__ import annotations

from pathlib import Path

import torch

from jetflow_sglang.head.config import target_signature


def _final_norm(model):
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} (expected model.model.norm)")
    return norm


@torch.no_grad()
def target_features(model, ids: torch.Tensor, att: torch.Tensor, tap_layers: list[int]):
    """One no-grad target forward over right-padded `ids` [B, T] (mask `att`) -> (taps [B, T, n*H], final [B, T, H])
    on the model's device, in the model's dtype. Shared by the feature cache and the online teacher (online.py)."""
    dev = next(model.parameters()).device
    got = {}
    hook = _final_norm(model).register_forward_hook(lambda m, a, out: got.__setitem__("final", out))
    try:
        out = model(input_ids=ids.to(dev), attention_mask=att.to(dev), output_hidden_states=True, use_cache=False,
                    logits_to_keep=1)
    finally:
        hook.remove()
    return torch.cat([out.hidden_states[l + 1] for l in tap_layers], -1), got["final"]


@torch.no_grad()
def teacher_forward(model, seqs: list[list[int]], tap_layers: list[int],
                    dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batch forward -> per sequence (taps [T, n*H], final [T, H]) in `dtype` on the CPU."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
    taps, final = target_features(model, ids, att, tap_layers)
    return [(taps[i, :len(s)].to("cpu", dtype).clone(), final[i, :len(s)].to("cpu", dtype).clone())
            for i, s in enumerate(seqs)]


def build_cache(model, records: list[dict], tap_layers: list[int], cache_dir, batch_tokens: int = 4096,
                shard_size: int = 128, progress: bool = True, tag: str = "",
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Compute (or resume) the feature cache for `records` (from data.read_records) and return it in record order.

    Only these records' features are loaded, so data-parallel ranks each hold their own shard; `tag` (e.g. the rank)
    names the files a process writes, so ranks building their shards at the same time never collide.
    `cache_dir=None` keeps the features in memory only (a GPU lease: no time spent writing tens of GB to disk).
    `dtype` is the stored precision (bf16: (taps + 1) x H x 2 bytes per token; tests use float64 to compare paths).
    """
    from tqdm import tqdm

    sig = {"tap_layers": list(tap_layers), "target": target_signature(model.config)}
    have = {}
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        have = load_cache(cache_dir, sig, keys={r["key"] for r in records})
    todo = sorted((r for r in records if r["key"] not in have), key=lambda r: len(r["ids"]))
    bar = tqdm(total=sum(len(r["ids"]) for r in todo), unit="tok", desc="teacher features", disable=not progress)
    prefix = f"feat_{tag}_" if tag else "feat_"
    shard, n_shards = [], 0 if cache_dir is None else \
        len([p for p in cache_dir.glob(prefix + "*.pt") if p.stem[len(prefix):].isdigit()])

    def flush():
        nonlocal shard, n_shards
        if shard and cache_dir is None:
            shard = []
        elif shard:
            tmp = cache_dir / f".{prefix}{n_shards:05d}.tmp"
            torch.save({"meta": sig, "items": shard}, tmp)
            tmp.rename(cache_dir / f"{prefix}{n_shards:05d}.pt")
            n_shards, shard = n_shards + 1, []

    i = 0
    while i < len(todo):
        # batch by tokens: sequences are sorted by length, so padding stays small
        j = i + 1
        while j < len(todo) and (j + 1 - i) * len(todo[j]["ids"]) <= batch_tokens:
            j += 1
        batch = todo[i:j]
        for r, (taps, final) in zip(batch, teacher_forward(model, [r["ids"] for r in batch], tap_layers, dtype)):
            item = {"key": r["key"], "source": r["source"], "mode": r["mode"], "prompt_len": r["prompt_len"],
                    "ids": torch.tensor(r["ids"], dtype=torch.long), "taps": taps, "final": final}
            have[r["key"]] = item
            shard.append(item)
            bar.update(len(r["ids"]))
        if len(shard) >= shard_size:
            flush()
        i = j
    flush()
    bar.close()
    return [have[r["key"]] for r in records if r["key"] in have]


def load_cache(cache_dir, sig: dict | None = None, keys: set[str] | None = None) -> dict[str, dict]:
    """Cached items by key (only `keys`, if given: one file at a time is read, the rest dropped); refuses a cache
    made with other tap layers or another target."""
    items = {}
    for p in sorted(Path(cache_dir).glob("feat_*.pt")):
        blob = torch.load(p, weights_only=False)
        if sig is not None and blob["meta"] != sig:
            raise ValueError(f"feature cache {p} was built for {blob['meta']}, not {sig}; use another --cache dir")
        for it in blob["items"]:
            if keys is None or it["key"] in keys:
                items[it["key"]] = it
        del blob
    return items
