"""Streaming sessions (`--enable-streaming-session`): a finished turn keeps its KV record for the next turn.

SGLang records the turn's KV as valid up to its prompt plus its output, clamped to the slots the turn allocated
(StreamingSession.try_cache_finished_req). Plain decoding never allocates a slot for its last output token, whose KV
was never computed, so the clamp leaves it out and the next turn computes it. A speculative round allocates slots
ahead for its tree; its last output token (the bonus, sampled after the verify) has a slot, but the slot holds the
KV of some draft node the verify wrote there, not the bonus token's. The clamp then lets the next turn attend to that
KV as the bonus token's, and its text parts from plain SGLang's. In a JETFLOW server this wrap records one token
less, so the next turn computes the last output token's KV as plain decoding's does (one more prefill token).
"""
from __future__ import annotations

from jetflow_sglang.sglang.compat import wrap


def install() -> None:
    """Wrap StreamingSession.try_cache_finished_req (listed in compat.PATCHES)."""
    from sglang.srt.session.streaming_session import StreamingSession

    def make(original):
        def try_cache_finished_req(self, req) -> bool:
            session_id = req.session.session_id if req.session is not None else None
            kept = original(self, req)
            slot = self.slots.get(session_id) if kept else None
            if slot is not None:  # the last output token's KV was never computed by the target
                computed = len(req.origin_input_ids) + len(req.output_ids) - 1
                slot.kv.kv_committed_len = max(slot.kv.cache_protected_len, min(slot.kv.kv_committed_len, computed))
            return kept
        return try_cache_finished_req

    wrap(StreamingSession, "try_cache_finished_req", make)
