"""Which drafters a head can serve: causal heads draft JetFlow trees, bidirectional heads DDTree/DFlash."""
from __future__ import annotations

from jetflow_sglang.draft.registry import BIDIRECTIONAL_DRAFTERS, CAUSAL_DRAFTERS
from jetflow_sglang.head.config import HeadMismatchError, JetFlowHeadConfig


def drafter_for(cfg: JetFlowHeadConfig, requested: str | None = None) -> str:
    """The drafter to run on a head: `requested` if the head fits it, else a one-line HeadMismatchError.
    None picks the head's own kind (causal -> jetflow, bidirectional -> ddtree)."""
    if requested is None:
        return CAUSAL_DRAFTERS[0] if cfg.causal else BIDIRECTIONAL_DRAFTERS[0]
    if requested in CAUSAL_DRAFTERS and not cfg.causal:
        raise HeadMismatchError(f"drafter {requested!r} needs a causal head, but this head is bidirectional "
                                f"(use --drafter {' or '.join(BIDIRECTIONAL_DRAFTERS)})")
    if requested in BIDIRECTIONAL_DRAFTERS and cfg.causal:
        raise HeadMismatchError(f"drafter {requested!r} needs a bidirectional head, but this head is causal "
                                f"(use --drafter {' or '.join(CAUSAL_DRAFTERS)}, or a bidirectional head)")
    return requested
