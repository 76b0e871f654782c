"""The drafter's per-slot pools inside SGLang's KV budget.

The worker's HeadKVPool holds one row per target KV slot (head layers x K and V x kv heads x head dim), and its
SlotTokens one int32 token id per slot. SGLang sizes the target's pool from the memory left after the weights
(`--mem-fraction-static` on a GPU) divided by the bytes one token costs (the pool configurator's cell size). For
EAGLE and DFLASH it adds the draft's per-token bytes there; for JETFLOW this hook does the same, so the target's pool
shrinks by exactly what the per-slot pools will take and they all stay inside the budget. (With
`--max-total-tokens` the token count is fixed and the pools add their bytes on top; the worker logs both.)

Each request's row of SGLang's req_to_token table is as long as the context plus a headroom. SGLang sizes that
headroom for a decode reservation of num_draft_tokens + 4 at page size 1, but reserves twice the draft tokens per
request and step (eagle_prepare_for_decode): a request that ran to within a few tokens of the context length wrote
past its row and the server died. For JETFLOW the headroom holds the whole reservation, as SGLang's own sizing does
for paged pools (`install_row_headroom`).
"""
from __future__ import annotations

import logging

import torch

from jetflow_sglang.sglang.compat import wrap

logger = logging.getLogger(__name__)


TOKEN_ID_BYTES = 4  # SlotTokens: the int32 token id of every slot (prompt lookup)


def head_bytes_per_token(head_cfg, dtype: torch.dtype) -> int:
    """Head layers x K and V x kv heads x head dim in the head's dtype."""
    return int(head_cfg.num_layers) * 2 * int(head_cfg.num_kv_heads) * int(head_cfg.head_dim) * \
        torch.empty((), dtype=dtype).element_size()


def jetflow_cell_bytes(kvc, draft_path: str | None) -> int:
    """Bytes per token the per-slot pools add for the target worker of a JETFLOW server (head K/V with a head, and
    the token id); 0 for other algorithms."""
    from jetflow_sglang.sglang.config import is_jetflow

    if getattr(kvc, "is_draft_worker", False) or not is_jetflow(getattr(kvc.spec_algorithm, "name", None)):
        return 0
    if not draft_path:
        return TOKEN_ID_BYTES  # head-less drafters (ngram) keep only the token ids
    from jetflow_sglang.head import read_head_config

    cfg, _ = read_head_config(draft_path, kvc.model_config.hf_config)
    return head_bytes_per_token(cfg, kvc.model_config.dtype) + TOKEN_ID_BYTES


def install() -> None:
    """Wrap the default pool configurator once per process (SGLang's plugin entry point calls this)."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator as C

    def make(original):
        def __init__(self, kvc):
            original(self, kvc)
            from sglang.srt.runtime_context import get_spec

            extra = jetflow_cell_bytes(kvc, getattr(get_spec(), "speculative_draft_model_path", None))
            if extra and self._cell_size:
                logger.info("JETFLOW: the per-slot pools (head K/V, token ids) add %d bytes per token to the "
                            "target's %d in the KV budget", extra, self._cell_size)
                self._cell_size += extra
        return __init__

    wrap(C, "__init__", make)


def row_headroom(stock: int, reserve: int, page_size: int) -> int:
    """req_to_token columns past the context length: SGLang's own headroom, or the decode reservation (twice the
    draft tokens, rounded up to a page), whichever is larger. A request holds at most the context length committed,
    so its reservation then ends inside its row."""
    return max(int(stock), int(reserve) + int(page_size) - 1)


def install_row_headroom() -> None:
    """Wrap SGLang's req_to_token headroom (read once, when the scheduler builds its pools) for JETFLOW servers."""
    from sglang.srt.mem_cache import allocation_sizing, kv_cache_configurator

    def make(original):
        def get_req_to_token_extra_context_len() -> int:
            from sglang.srt.runtime_context import get_spec

            from jetflow_sglang.sglang.config import is_jetflow

            stock = original()
            if not is_jetflow(get_spec().speculative_algorithm):
                return stock
            return row_headroom(stock, allocation_sizing.get_alloc_reserve_per_decode(),
                                allocation_sizing.get_alloc_page_size())
        return get_req_to_token_extra_context_len

    for module in (allocation_sizing, kv_cache_configurator):  # the pool builder imported it by name
        wrap(module, "get_req_to_token_extra_context_len", make)
