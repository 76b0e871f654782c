"""JetFlowWorker: SGLang's V2 speculative worker for JETFLOW, batched, on the overlap scheduler or synchronous.

Per scheduler step:
  prefill  the target runs with the head's tap layers captured; the taps of every extended token (each chunk of a
           chunked prefill) become head context K/V at the token's own KV slot (HeadKVPool), so a radix-cache
           prefix hit finds the head's rows next to the target's.
  decode   draft   one head forward for the whole batch over its paged context -> per-depth top-k -> the batched
                   exact tree builder (tree_batch.build_topb); budget 0 skips the head (plain decoding);
                   with JETFLOW_LOOKUP each request's prompt-lookup trie is merged in, on the device too
                   (lookup_batch.merge_lookup over the token ids kept per KV slot: SlotTokens); the head-less
                   ngram drafter is that trie alone
           verify  one TARGET_VERIFY forward of all bs*n nodes under a tree mask built on the device
           accept  each node's logits processed as plain decoding would (penalties, grammar, logit_bias, custom
                   processors along the node's path: logit_chain.py), then greedy and rejection-sampling acceptance
                   on the device (accept.py)
           commit  accepted nodes' target K/V moved to the front of the verify window, their head K/V written there;
                   the carry (each request's last token and length) published for the next round
The round never waits for the device outside grammar and penalty batches: the anchors come from the carry (on the
overlap scheduler SGLang relays it through its FutureMap), host bounds come from the requests' KV bookkeeping, and
statistics and the adaptive budget's feedback are read back a round later (readback.py). The scheduler does the rest
(appending tokens, stop conditions, batching, filter/merge, accept statistics).
Settings come only from jetflow_sglang.sglang.config.JetFlowServerConfig.
"""
from __future__ import annotations

import logging
import statistics

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from jetflow_sglang.sglang.config import ALGORITHM, JetFlowServerConfig
from jetflow_sglang.sglang.compat import wrap
from jetflow_sglang.draft.registry import HEAD_DRAFTERS, SERVER_DRAFTERS, spec
from jetflow_sglang.core.tree_batch import TreeBatch, root_only
from jetflow_sglang.sglang.accept import accept_batch, to_sglang, truncation
from jetflow_sglang.sglang.attention.guard import TREE_TRITON, full_mask, verify_backend
from jetflow_sglang.sglang.head_pool import HeadKVPool, SlotTokens, slots_of
from jetflow_sglang.sglang.host_syncs import SyncCounter
from jetflow_sglang.sglang import logit_chain
from jetflow_sglang.sglang.fixes import sessions
from jetflow_sglang.sglang.fixes.penalties import install_prefill_history, install_sync_fallback, needs_history
from jetflow_sglang.sglang.readback import Readback
from jetflow_sglang.sglang.tp_sync import broadcast_from_rank0, broadcast_object_from_rank0, make_generator
from jetflow_sglang.sglang.verify_input import JetFlowCarry, JetFlowVerifyInput, verify_tensors

logger = logging.getLogger(__name__)


class StepStats:
    """What the last decode steps did: the budget chosen, the batch, the mean accept length and the round's time by
    phase (exported through the scheduler's internal state: /server_info -> internal_states[i]["jetflow"])."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self.steps = 0
        self.plain_steps = 0
        self.recent: list = []  # readback.Round, newest last

    def record(self, r) -> None:
        """r: a readback.Round (it reaches the host a round late on a GPU)."""
        self.steps += 1
        self.plain_steps += r.budget <= 1
        self.recent = (self.recent + [r])[-self.keep:]

    def snapshot(self, pool=None) -> dict:
        last = self.recent[-1] if self.recent else None
        out = {"steps": self.steps, "plain_steps": self.plain_steps,
               "last_budget": last.budget if last else 0, "last_batch": last.batch if last else 0,
               "last_accept_len": last.mean_accept if last else 0.0,
               "last_round_s": sum(last.split.values()) if last else 0.0,
               "recent_budgets": [r.budget for r in self.recent],
               "recent_accept_lens": [r.mean_accept for r in self.recent]}
        if self.recent:  # median seconds per phase over the recent rounds; `scheduler`: the host between rounds
            phases = {k: [r.split[k] for r in self.recent] for k in last.split}
            phases["scheduler"] = [r.host_gap_s for r in self.recent[1:]] or [0.0]
            out["round_split"] = {k: round(statistics.median(v), 6) for k, v in phases.items()}
        if pool is not None:
            out["head_pool_slots"], out["head_pool_bytes"] = pool.size, pool.bytes
        return out


def _install_server_info_hook() -> None:
    """/server_info's internal_states gain a "jetflow" entry (per-step budget, accept length, head pool) from the
    scheduler's speculative worker, and `avg_spec_accept_length` from the first round on (SGLang's own is None until
    its first decode log). SGLang 0.5.23 has no hook for plugin algorithms (only DSPARK's records), so its
    collector method is wrapped once, in the scheduler process, when a JETFLOW worker starts."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController as C

    def make(original):
        def _add_speculative(self, state):
            original(self, state)
            worker = getattr(self.scheduler, "draft_worker", None)
            if hasattr(worker, "jetflow_server_info"):
                state["jetflow"] = worker.jetflow_server_info()
                m = self.scheduler.metrics_reporter  # SGLang folds its counters in every --decode-log-interval steps
                rounds = m.spec_total_num_forward_ct + m.spec_num_forward_ct  # only: count the open interval too
                if state.get("avg_spec_accept_length") is None and rounds > 0:
                    state["avg_spec_accept_length"] = (m.spec_total_num_accept_tokens
                                                       + m.spec_num_accept_tokens) / rounds
        return _add_speculative

    wrap(C, "_add_speculative", make)


class JetFlowWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.cfg = JetFlowServerConfig.from_server_args(server_args)
        self.n = self.cfg.budget
        self.context_len = int(self.model_runner.model_config.context_len)
        self.head = self._load_head() if self.cfg.needs_head else None
        if self.head is None and spec(self.cfg.drafter).head is not None:
            raise ValueError(f"JETFLOW drafter {self.cfg.drafter!r} needs a head")
        self.drafter_name = self._drafter_name()
        if not spec(self.drafter_name).server:
            raise ValueError(f"JETFLOW_DRAFTER={self.drafter_name} is not available in the batched server; "
                             f"use one of {', '.join(n for n in SERVER_DRAFTERS if n in HEAD_DRAFTERS)}")
        self.ngram = None  # prompt lookup: merged into the head's trees (JETFLOW_LOOKUP), or the head-less drafter
        if (self.head is not None and self.cfg.lookup) or (self.head is None and self.cfg.drafter == "ngram"):
            from jetflow_sglang.draft.drafters import NgramDrafter

            self.ngram = NgramDrafter()
        self.depth = self._depth()
        self.width = self.cfg.width
        self.head_drafter = None
        if self.head is not None:  # the registry's drafter, drafting the batch over the pool's padded context K/V
            from jetflow_sglang.draft.drafters import HeadDrafter

            self.head_drafter = HeadDrafter(self.head, mode=spec(self.drafter_name).mode, width=self.width,
                                            depth=self.depth, name=self.drafter_name, scores=self.ngram is not None)
        # A chain's accepted nodes are its first ones, already at the front of the verify window: no KV move
        self.chain = self.head_drafter is not None and self.head_drafter.mode == "chain" and self.ngram is None
        self.capture = CaptureHiddenMode.FULL if self.head is not None else None
        if str(self.device) == "cpu":  # verify GEMMs of batch x tree rows at one weight read (cpu/gemm.py)
            from jetflow_sglang.sglang.cpu import gemm, paging

            gemm.install(self.model_runner.model, self.head_drafter.gemm_weights() if self.head_drafter else ())
            paging.install()  # --page-size > 1: SGLang's KV reservation for a round, without Triton
        # the mask layout of the backend that runs verify (the prefill one unless speculative_attention_mode=decode)
        view = resolved_view(server_args)  # SGLang's decisions over the operator's raw flags
        self.full_mask = full_mask(verify_backend(view))
        # the head attends to its pool in place through the Triton tree kernel where Triton runs (head_pool.py)
        self.paged_head = self.head is not None and (str(self.device).startswith("cuda")
                                                     or verify_backend(view) == TREE_TRITON)
        self.adaptive = self._make_budget() if self.cfg.adaptive else None
        self.graphs = None  # JETFLOW_GRAPHS: head (paged), tree build and acceptance replayed per (bucket, budget)
        if self.cfg.graphs != "off":
            from jetflow_sglang.core.graphs import GraphRunner, default_backend

            self.graphs = GraphRunner(default_backend(self.device), check=self.cfg.graphs == "check")
            if self.head_drafter is not None:
                self.head_drafter.runner = self.graphs
        self.generator = make_generator(server_args, self.device, offset=0x7E7F)  # the same on every TP rank
        # On SGLang's overlap scheduler the host runs a round ahead of the results: each request's committed length
        # on the host lags by the round in flight (its tree size: self._lag), and the next inputs arrive through the
        # FutureMap. SGLang resolves disable_overlap_schedule before the worker starts.
        self.overlap = not view.disable_overlap_schedule
        self._lag = 0
        if self.overlap:
            install_sync_fallback(ALGORITHM)
        install_prefill_history()  # a retracted request's prefill token sees its penalties (fixes/penalties.py)
        sessions.install()  # a streaming session's next turn computes the last output token's KV
        self.readback = Readback(self.device)
        self.syncs = SyncCounter() if self.cfg.count_syncs else None
        self.stats = StepStats()
        self.pool: HeadKVPool | None = None
        self.tokens: SlotTokens | None = None
        _install_server_info_hook()
        logger.info("JETFLOW worker: %s depth=%d overlap=%s tree mask=%s head context=%s", self.cfg.describe(),
                    self.depth, self.overlap, "FULL" if self.full_mask else "QLEN_ONLY",
                    "paged" if self.paged_head else "padded")

    # -- setup -------------------------------------------------------------------------------------------------
    def _load_head(self):
        from jetflow_sglang.sglang.target_view import load_head_for_runner

        head = load_head_for_runner(self.model_runner, self.cfg.head_dir)
        model = self.model_runner.model
        taps = list(head.config.tap_layers)
        if taps != sorted(taps):
            raise ValueError(f"head tap layers must be ascending (SGLang concatenates them in layer order): {taps}")
        n_layers = self.model_runner.model_config.hf_config.num_hidden_layers
        if taps[-1] + 1 >= n_layers:
            raise ValueError(f"tap layer {taps[-1]} is the target's last layer; SGLang can capture up to "
                             f"layer {n_layers - 2}")
        if not hasattr(model, "set_dflash_layers_to_capture"):
            raise ValueError(f"{type(model).__name__} cannot expose hidden states to a draft head in SGLang")
        model.set_dflash_layers_to_capture(taps)
        return head

    def _drafter_name(self) -> str:
        """The drafter for this head: the configured one, checked against the head's kind (a causal head drafts with
        jetflow, a bidirectional one with ddtree/dflash); the default follows the head."""
        if self.head is None:
            return self.cfg.drafter
        from jetflow_sglang.draft.fit import drafter_for
        from jetflow_sglang.head import HeadMismatchError

        try:
            return drafter_for(self.head.config, self.cfg.drafter)
        except HeadMismatchError:
            if self.cfg.drafter != "jetflow":  # an explicit choice that does not fit the head
                raise
            return drafter_for(self.head.config, None)

    def _depth(self) -> int:
        if self.head is not None:
            d = self.head.config.block_size - 1
        else:
            d = self.ngram.max_depth if self.ngram is not None else self.n - 1
        if self.cfg.depth is not None:
            d = min(d, self.cfg.depth)
        return max(1, min(d, self.n - 1)) if self.n > 1 else 1

    def _make_budget(self):
        """`auto`: every step picks a budget in {0, 1, 2, 4, ..., max} (0 and 1: plain decoding, no head forward)."""
        from jetflow_sglang.core.budget import AdaptiveBudget

        prior = getattr(self.cfg, "cost_prior", None)  # {verified tokens: seconds}, JETFLOW_COST_PRIOR (config.py)
        return AdaptiveBudget(max_budget=self.n, allow_zero=True, cost_prior=prior)

    # -- BaseSpecWorker plumbing ------------------------------------------------------------------------------
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()
        kv = self.model_runner.token_to_kv_pool
        rows = kv.get_key_buffer(kv.start_layer if hasattr(kv, "start_layer") else 0).shape[0]
        if str(self.device) == "cpu":  # the CPU stand-in of SGLang's KV move kernel views the buffers once
            from jetflow_sglang.sglang.cpu import ops as cpu_ops

            cpu_ops.POOL_ROWS["rows"] = rows
        if self.ngram is not None:
            self.tokens = SlotTokens(rows, self.device)
        if self.head is not None:
            self.pool = HeadKVPool(self.head, rows, self.device)
            logger.info("JETFLOW head K/V pool: %d slots, %.1f MiB (counted in the KV budget: fixes/memory.py)", rows,
                        self.pool.bytes / 2**20)

    def clear_cache_pool(self):
        pass  # rows belong to KV slots; a flushed cache frees the slots and later writes overwrite the rows

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        pass

    def jetflow_server_info(self) -> dict:
        out = {**self.stats.snapshot(self.pool), "lookup": self.ngram is not None and self.head is not None,
               "overlap": self.overlap}
        if self.syncs is not None:
            out["host_syncs"] = self.syncs.snapshot()
            out["host_syncs_per_round"] = out["host_syncs"]["mean_plain"]  # outside grammar and penalty rounds
        if self.graphs is not None:
            out["graphs"] = self.graphs.snapshot()
        if self.adaptive is not None:  # its estimates at the last step's batch size: why it picks what it picks
            out["auto"] = self.adaptive.snapshot(max(1, out["last_batch"]))
        if self.pool is not None:  # head rows in use = target slots in use (running requests + radix cache)
            out["head_pool_used"] = int(self.pool.size - 1 - self.token_to_kv_pool_allocator.available_size())
        return out

    # -- one scheduler step ------------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None) -> GenerationBatchResult:
        if not batch.forward_mode.is_decode():
            return self._prefill(batch, on_publish, pp_proxy_tensors)
        if self.syncs is None:
            return self._decode(batch, on_publish)
        with self.syncs.round(len(batch.reqs), batch.has_grammar, needs_history(batch.reqs)):
            return self._decode(batch, on_publish)

    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        self._read_back()
        bs, phase = len(batch.reqs), self.readback.phase
        budget = broadcast_object_from_rank0(self.adaptive.choose(bs)) if self.adaptive else self.n
        lens = self._host_lens(batch)
        batch.max_seq_len_host = max(lens, default=0)
        budget = min(budget, self._reserved(batch), self._room(batch.max_seq_len_host))
        with phase("head"):
            anchors, ctx, drafted = self._head(batch, budget)
        with phase("tree"):
            tree = self._tree(batch, anchors, ctx, drafted, budget)
            if self.syncs is not None:
                self.syncs.tag(tree.tokens.shape[1])  # the round's key: batch x tree width
            broadcast_from_rank0([tree.tokens, tree.parents, tree.depths, tree.sizes])  # TP ranks verify one tree
        with phase("verify"):
            out, res, links = self._verify(batch, tree, sum(lens))
        with phase("accept"):
            path, bonus = self._accept(batch, tree, out, links)
            broadcast_from_rank0([path, bonus])  # ... and accept one path
        with phase("commit"):
            result = self._commit(batch, tree, out, res, path, bonus, on_publish)
            self._lag = tree.tokens.shape[1]
            if not self.overlap:
                self._fit_reserve(batch, self._lag)
            self.readback.push(budget, bs, path)  # the round's end
        return result

    def _read_back(self) -> None:
        """Rounds whose results have reached the host (on a CPU: the last one; on a GPU: those whose copies have
        completed, never waiting): statistics, and the adaptive budget's feedback at the budget each was run at."""
        for r in self.readback.ready():
            self.stats.record(r)
            if self.adaptive is not None:
                self.adaptive.observe_batch(r.paths, r.budget, verify_s=r.verify_s, draft_s=r.draft_s)

    def _fit_reserve(self, batch, n: int) -> None:
        """Near a full KV pool, lower the draft tokens SGLang reserves per request for the next step (2x, see
        eagle_prepare_for_decode), down to 1 (plain decoding), instead of letting the scheduler fail with "out of
        memory even after retracting"; raise it back when there is room. The per-step budget follows (_reserved).
        Synchronous scheduling only (host bookkeeping: each request grows by at most this round's n tokens); on the
        overlap scheduler the reservation stays at 2x the budget, as for SGLang's EAGLE, and SGLang retracts."""
        from sglang.srt.runtime_context import get_spec

        alloc = self.token_to_kv_pool_allocator
        free = alloc.available_size()
        cache = getattr(batch, "tree_cache", None)
        if cache is not None and hasattr(cache, "evictable_size"):
            free += cache.evictable_size()
        lens = [r.kv.kv_committed_len + n for r in batch.reqs]
        allocated = [r.kv.kv_allocated_len for r in batch.reqs]
        need = lambda k: sum(max(0, m + 2 * k - a) for m, a in zip(lens, allocated))  # noqa: E731
        k = self.n
        while k > 1 and need(k) > free:
            k = max(1, k // 2)
        if k != getattr(self, "_reserve_k", self.n):
            bag = get_spec()
            for name in ("speculative_num_draft_tokens", "max_speculative_num_draft_tokens"):
                if name in bag:  # SGLang's decode reservation reads both; the second is a derived leaf, which
                    bag._set(name, k)  # its public override (RuntimeContext.override) refuses: compat.SERVING
            logger.info("JETFLOW: KV pool %s; reserving %d draft tokens per request", "tight" if k < self.n else
                        "has room again", k)
            self._reserve_k = k

    def _host_lens(self, batch) -> list[int]:
        """Host bounds on each request's committed length, from SGLang's KV bookkeeping (no device read): exact when
        synchronous; on the overlap scheduler each request may hold up to the round in flight beyond what the host
        has committed, and never more than its allocation."""
        lag = self._lag if self.overlap else 0
        return [min(r.kv.kv_allocated_len, r.kv.kv_committed_len + lag) for r in batch.reqs]

    def _room(self, max_len: int) -> int:
        """The most tree nodes whose positions stay below the context length: a node at depth d sits at position
        committed + d and predicts the token after it, which must still fit (plain decoding's last input sits at
        context length - 2). Near the end of the context the round's tree shrinks; the target never sees a position
        plain decoding could not reach (past the model's rotary table, an index error)."""
        return max(1, self.context_len - 1 - max_len)

    def _reserved(self, batch) -> int:
        """KV slots SGLang reserved past every request's committed tokens this step (a near-full pool may leave
        fewer than the budget): the tree may not be larger. On the overlap scheduler the host's committed lengths
        lag by the round in flight, which may still take up to its tree size."""
        lag = self._lag if self.overlap else 0
        return max(1, min((r.kv.kv_allocated_len - r.kv.kv_committed_len - lag for r in batch.reqs), default=self.n))

    @torch.no_grad()
    def _prefill(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        res = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors,
                                                          capture_hidden_mode=self.capture)
        bs = len(batch.reqs)
        if self.tokens is not None and batch.forward_mode.is_extend() and bs:
            self.tokens.write(batch.out_cache_loc, batch.input_ids)
        if self.pool is not None and batch.forward_mode.is_extend() and bs:
            hidden = res.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError("the target returned no hidden states; its model class does not capture taps")
            dev = hidden.device
            ext = torch.tensor(batch.extend_lens, device=dev)
            start = torch.tensor(batch.prefix_lens, device=dev)
            first = torch.cumsum(ext, 0) - ext
            pos = torch.arange(hidden.shape[0], device=dev) - torch.repeat_interleave(first - start, ext)
            self.pool.write(batch.out_cache_loc, hidden, pos)
        new_seq_lens = batch.seq_lens.clone()
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        next_ids = res.next_token_ids if bs else torch.zeros(0, dtype=torch.long, device=self.device)
        return GenerationBatchResult(
            logits_output=res.logits_output, next_token_ids=res.next_token_ids,
            can_run_cuda_graph=res.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=JetFlowCarry(next_ids.long(), new_seq_lens), speculative_num_draft_tokens=self.n)

    # -- draft: one head forward for the batch, then its tree ------------------------------------------------
    @torch.no_grad()
    def _head(self, batch, budget: int):
        """(anchors, the head's context, its output): the head's forward, when this round drafts with it."""
        anchors = self._anchors(batch)
        if budget <= 1 or self.head is None:  # plain decoding (the ar drafter always), or the ngram drafter
            return anchors, None, None
        # paged: the block's rows go to the slots reserved for this round (budget >= rows: _decode)
        rows = self.head_drafter.block_rows(budget)
        ctx = self.pool.context(batch.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                batch.max_seq_len_host, rows, paged=self.paged_head and rows <= budget)
        return anchors, ctx, self.head_drafter.head_batch(anchors, ctx, batch.seq_lens, budget)

    @torch.no_grad()
    def _tree(self, batch, anchors, ctx, out, budget: int) -> TreeBatch:
        """The round's tree: the head's top-B tree (its second forward for branch trees), prompt lookup merged in."""
        if budget <= 1 or (self.head is None and self.ngram is None):
            return root_only(anchors, 1)
        ctx_lens = batch.seq_lens  # committed tokens before each anchor
        tree = root_only(anchors, budget) if out is None else \
            self.head_drafter.tree_batch(anchors, out, ctx, ctx_lens, budget)
        if self.ngram is not None:  # at T > 0 the device accept tests a node's first `width` (best) children
            slots = slots_of(batch.req_to_token_pool.req_to_token, batch.req_pool_indices, ctx_lens,
                             batch.max_seq_len_host)  # a host bound; positions past ctx_lens read the padding slot
            tree = self.ngram.merge_batch(tree, self.tokens.history(slots), ctx_lens, budget)
        return tree

    def _anchors(self, batch) -> torch.Tensor:
        """Each request's last token: the carry's (on the device; SGLang's FutureMap writes it on the overlap
        scheduler, where the host's output_ids are a round behind). A batch without one (none is known to reach
        here) falls back to the host's output_ids, a blocking copy that is right only when synchronous."""
        carry = batch.spec_info
        if isinstance(carry, JetFlowCarry) and carry.bonus_tokens is not None \
                and carry.bonus_tokens.shape[0] == len(batch.reqs):
            return carry.bonus_tokens.to(self.device, torch.long)
        return torch.tensor([r.output_ids[-1] for r in batch.reqs], dtype=torch.long, device=self.device)

    # -- verify: one TARGET_VERIFY forward --------------------------------------------------------------------
    @torch.no_grad()
    def _verify(self, batch, tree: TreeBatch, total_len: int):
        bs, n = tree.tokens.shape
        max_len, total = (batch.max_seq_len_host, total_len) if self.full_mask else (None, None)
        tokens, mask, positions, r_index, r_next, r_sib = verify_tensors(
            tree.tokens, tree.parents, tree.depths, tree.sizes, tree.ancestor_mask(), batch.seq_lens, self.full_mask,
            max_len, total)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = tokens
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens, end_offset=batch.seq_lens + n, batch_size=bs, draft_token_num=n,
            device=self.device)
        batch.spec_info = JetFlowVerifyInput(
            draft_token=tokens, custom_mask=mask, positions=positions, retrieve_index=r_index,
            retrieve_next_token=r_next, retrieve_next_sibling=r_sib, draft_token_num=n,
            capture_hidden_mode=self.capture or CaptureHiddenMode.NULL)
        res = self.target_worker.forward_batch_generation(batch, is_verify=True, capture_hidden_mode=self.capture)
        return res.logits_output, res, (r_next, r_sib)

    # -- accept: on the device ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _accept(self, batch, tree: TreeBatch, out, links):
        """Acceptance on each node's logits processed as plain decoding would (penalties, grammar, logit_bias, custom
        processors: logit_chain.py); the returned logprobs are read from the same processed logits, as plain's are."""
        out.next_token_logits = logit_chain.process(out.next_token_logits, batch, tree, links)  # links: _verify's
        info = batch.sampling_info  # the sort rule is read only where a sampled request needs it
        keep = None if info.is_all_greedy else truncation([r.sampling_params for r in batch.reqs],
                                                          out.next_token_logits.shape[-1])
        return accept_batch(tree, out.next_token_logits, batch.sampling_info, self.width, self.generator, keep,
                            self.graphs)

    # -- commit: KV move, head rows, result ---------------------------------------------------------------------
    @torch.no_grad()
    def _commit(self, batch, tree: TreeBatch, out, res, path, bonus, on_publish) -> GenerationBatchResult:
        bs, n = tree.tokens.shape
        predict, accept_index, accept_lens, _ = to_sglang(tree.tokens, path, bonus, n)
        if n > 1 and not self.chain:  # a chain's (and a lone root's) accepted rows are in place already
            move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        # the verify rows of each request's accepted path, root first, at the front of its window (padding: its root)
        src = torch.where(accept_index >= 0, accept_index.long(),
                          (torch.arange(bs, device=self.device) * n)[:, None].expand(bs, n)).reshape(-1)
        if self.pool is not None or self.tokens is not None:  # per-slot rows of the accepted nodes
            cols = torch.arange(n, device=self.device)[None]
            pos = batch.seq_lens.long()[:, None] + cols
            loc = batch.out_cache_loc.view(bs, n)  # the verify window's slots (req_to_token may be reused by now)
            keep = cols < accept_lens[:, None]  # only accepted rows: the others may hold nothing of this request
            loc = torch.where(keep, loc.long(), torch.zeros_like(loc, dtype=torch.long)).reshape(-1)  # 0: padding
            if self.tokens is not None:
                self.tokens.write(loc, tree.tokens.view(-1)[src])
            if self.pool is not None:
                self.pool.write(loc, out.hidden_states[src], pos.reshape(-1))
        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, out, predict, accept_index=accept_index)
        if out.hidden_states is not None and any(r.return_hidden_states for r in batch.reqs):
            out.hidden_states = out.hidden_states[src]  # SGLang returns rows [i*n, i*n + accept_len) per request
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = predict[accept_index.long()].flatten()  # -1 slots read garbage the scheduler never looks at
        return GenerationBatchResult(
            logits_output=out, next_token_ids=accept_tokens, can_run_cuda_graph=res.can_run_cuda_graph,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=JetFlowCarry(bonus.long(), new_seq_lens), speculative_num_draft_tokens=n)
