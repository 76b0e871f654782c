"""One explorer run: stream a generation into a Session (with the target's view of every round), then measure
plain decoding of the same prompt for the speedup."""
from __future__ import annotations

import inspect
import time
from typing import Iterator

from jetflow_sglang.engine.loop import autoregressive, generate

from .models import SEED, WIDTH, Models
from .session import Session
from .target_view import TOPK, RecordingTarget, round_view

_ENGINE_TOPK = "target_topk" in inspect.signature(generate).parameters  # generate(..., target_topk=k) (H1)


def stream(models: Models, s: Session, prompt: str, drafter: str, budget: int, temperature: float,
           max_tokens: int, stop_at_eos: bool, measure_ar: bool) -> Iterator[Session]:
    """Yields `s` after every round. Only the engine's own work is timed (`s.compute_s`): the page updates
    between rounds and the target's-view bookkeeping are not."""
    d = models.drafter(drafter)
    ids = models.target.encode_chat(prompt)
    s.reset(prompt, drafter, budget, dict(temperature=temperature, top_k=0, top_p=1.0, max_tokens=max_tokens, eos=stop_at_eos,
                                          width=WIDTH, seed=SEED, dtype=models.dtype))
    eos = models.eos_ids if stop_at_eos else ()
    rec = RecordingTarget(models.target)
    kw = dict(target_topk=TOPK) if _ENGINE_TOPK else {}
    rounds = generate(rec, d, ids, max_new_tokens=max_tokens, budget=budget, temperature=temperature,
                      eos_ids=eos, seed=SEED, **kw)
    try:
        while True:
            t0 = time.perf_counter()
            rnd = next(rounds, None)
            s.compute_s += time.perf_counter() - t0
            if rnd is None:
                break
            if rnd.tree is None:  # the prefill token: text only, no tree
                s.add_prefill(rnd.new_tokens, models.decode)
                continue
            view = round_view(rnd.tree, rec.last_logits, temperature, engine_top=getattr(rnd, "target_top", None))
            rec.last_logits = None
            s.add_round(rnd.tree, rnd.path, rnd.new_tokens, rnd.draft_s, rnd.verify_s, models.decode, view,
                        models.decode_one)
            yield s
            if s.stop_requested:
                break
    finally:
        rounds.close()
    if measure_ar and not s.stop_requested:
        s.running_ar = True
        yield s
        ar = autoregressive(models.target, ids, max_new_tokens=max_tokens, temperature=temperature, eos_ids=eos,
                            seed=SEED)
        s.ar_tokens_per_s = ar.tokens_per_s
        s.ar_identical = (ar.tokens == s.tokens) if temperature == 0 else None
        s.running_ar = False
