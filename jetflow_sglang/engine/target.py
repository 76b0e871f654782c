"""The frozen target model (HF Llama / Qwen3): prefill, one-forward tree verification, KV compaction."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from jetflow_sglang.kernels import hf_tree_attention as tree_attn  # registers attn_implementation="jetflow_tree"

from jetflow_sglang.core import rowgemm
from jetflow_sglang.head.config import default_tap_layers
from jetflow_sglang.core.tree import DraftTree

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def target_config(path):
    """The HF config of a target folder, read without loading weights; one-line ValueError when the folder or its
    config.json is unusable (missing, not JSON, not an object, an unknown architecture)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    cfg_file = Path(path) / "config.json"
    if Path(path).is_dir():
        if not cfg_file.is_file():
            raise ValueError(f"target folder {path} has no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"cannot read target config {cfg_file}: {' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"cannot read target config {cfg_file}: expected a JSON object, found a {type(raw).__name__}")
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read target config in {path}: {' '.join(str(e).split())[:300]}") from None
    for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if not isinstance(getattr(cfg, name, None), int):
            raise ValueError(f"target config in {path} has no integer {name}; is it a decoder-only language model?")
    return cfg


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """'auto': bfloat16 where matrix maths runs natively in it (CUDA, or a CPU with AVX512-BF16 or AMX), else
    float32. Without native bf16 a CPU emulates it, and a multi-token verify then costs several one-token steps."""
    if name != "auto":
        return name
    if str(device).startswith("cuda"):
        return "bfloat16"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


class Target:
    """Batch-1 wrapper owning one KV cache. `length` counts committed tokens in the cache."""

    def __init__(self, model, tokenizer=None, tap_layers: list[int] | None = None):
        self.model = rowgemm.enable(model.eval().requires_grad_(False))  # multi-row verify GEMMs as W @ X^T on CPU
        self.tokenizer = tokenizer
        self.tap_layers = list(tap_layers or default_tap_layers(model.config.num_hidden_layers, 4))
        self.cache: DynamicCache | None = None
        self.length = 0
        self.exact = False  # every verify row rounds as a one-token step does (exact.enable; --exact on)

    @classmethod
    def from_pretrained(cls, path, dtype: str = "auto", device: str = "cpu", tap_layers=None) -> "Target":
        dtype = resolve_dtype(dtype, device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
        # jetflow_tree: the Triton tree kernel on CUDA, SDPA with a bool tree mask on CPU; plain SDPA outside verify.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=tree_attn.NAME)
        model = model.to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), tap_layers)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def check_prompt(self, ids) -> None:
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_length}")

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, keep: int = 0):
        """keep > 0: logits of the last `keep` rows only (a prefill needs one row, not one per prompt token)."""
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                         past_key_values=self.cache, use_cache=True, output_hidden_states=True, logits_to_keep=keep)
        hs = out.hidden_states  # hs[l + 1] is the output of decoder layer l
        taps = torch.cat([hs[l + 1][0] for l in self.tap_layers], -1)
        return out.logits[0].float(), taps

    @torch.no_grad()
    def prefill(self, ids, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, taps): logits of the last prompt token [1, V] (every token's with all_logits), taps of all."""
        self.check_prompt(ids)
        self.cache = DynamicCache(config=self.config)
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        out = self._forward(ids, torch.arange(len(ids), device=self.device), None, keep=0 if all_logits else 1)
        self.length = len(ids)
        return out

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """All nodes in one forward: node i sees the committed prefix, its ancestors and itself."""
        dev, n = self.device, len(tree)
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=dev)
        positions = self.length + torch.tensor(tree.depths, dtype=torch.long, device=dev)
        if n == 1 and not self.exact:  # a plain decoding step: causal attention, no tree mask
            return self._forward(ids, positions, None)
        if self.model.config._attn_implementation == tree_attn.NAME:  # the mask travels packed: N x ceil(N/32) words
            with tree_attn.tree_mask_context(tree.packed_mask(), self.length, self.exact):
                return self._forward(ids, positions, None)
        allow = torch.ones(n, self.length + n, dtype=torch.bool, device=dev)
        allow[:, self.length:] = tree.ancestor_mask().to(dev)
        # Float additive mask: the eager attention path mishandles boolean 4D masks.
        mask = torch.zeros(allow.shape, dtype=self.dtype, device=dev).masked_fill(~allow, torch.finfo(self.dtype).min)
        return self._forward(ids, positions, mask[None, None])

    def commit(self, path: list[int]) -> None:
        """Keep the KV rows of the accepted nodes (root first) after the prefix; drop the rest of the tree."""
        if len(path) == 1 and self.cache.get_seq_length() == self.length + 1:  # root only: its row is in place
            self.length += 1
            return
        src = self.length + torch.tensor(path, dtype=torch.long, device=self.device)
        end = self.length + len(path)
        for layer in self.cache.layers:  # move only the accepted rows; the prefix stays where it is
            layer.keys[..., self.length:end, :] = layer.keys[..., src, :]
            layer.values[..., self.length:end, :] = layer.values[..., src, :]
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self.length = end

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """Token ids of a single-turn chat prompt with the model's own chat template."""
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty")
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        return tok.encode(prompt)

    def eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.config, getattr(self.model, "generation_config", None), self.tokenizer):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            ids |= set(e) if isinstance(e, (list, tuple)) else ({e} if e is not None else set())
        return ids
