"""JetFlowWorker: SGLang's V2 speculative worker for JETFLOW (synchronous; overlap scheduling off).

Per scheduler step:
  prefill  the target runs with the head's tap layers captured (SGLang's DFlash/EAGLE3 aux-hidden hook);
           those rows are kept per request id until its first decode round.
  decode   for each request: drafter -> tree of <= n nodes (n = --speculative-num-draft-tokens, root = the
           last committed token); one TARGET_VERIFY forward of all bs*n nodes under the tree mask;
           greedy or sampled acceptance with jetflow_sglang.verify (lossless); the accepted nodes' KV is moved
           to the front of the request's window; the accepted taps advance the drafter state.
The scheduler does the rest: appending tokens, EOS / max_tokens / stop strings, batching, filter and merge,
and the accept-length statistics (`spec_accept_length` in meta_info, `avg_spec_accept_length` in
/get_server_info, `sglang:spec_accept_length` in /metrics) computed from the accept_lens returned here.

Knobs (environment, read in the scheduler process; see docs/SGLANG.md):
  JETFLOW_DRAFTER  jetflow (default with a head) | jetflow-branch | ddtree | dflash | ngram (default without) | ar
  JETFLOW_WIDTH    top-k children per node (default 8; also --speculative-eagle-topk)
  JETFLOW_DEPTH    max tree depth (default: head block size - 1; also --speculative-num-steps)
"""
from __future__ import annotations

import logging
import os
import time
import types
from dataclasses import dataclass, field

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

from ..budget import AdaptiveBudget
from ..drafters import make_drafter
from ..tree import DraftTree
from ..verify import greedy_accept, process_logits, sample_accept
from .verify_input import JetFlowVerifyInput, pack_trees

logger = logging.getLogger(__name__)
HEAD_DRAFTERS = ("jetflow", "jetflow-branch", "ddtree", "dflash")


@dataclass
class _Req:
    state: object = None  # the drafter's per-request state
    taps: list = field(default_factory=list)  # prefill tap rows not yet handed to the drafter
    generator: torch.Generator | None = None


class _TargetView:
    """What `load_head(dir, target)` needs from the target: its HF config and its embedding / LM head."""

    def __init__(self, model, hf_config):
        self.config = hf_config
        self._model = model
        # SGLang pads vocab-parallel weights (376 -> 384 rows); views of the real rows share the target's memory.
        v = hf_config.vocab_size
        self._emb = torch.nn.Embedding(v, hf_config.hidden_size, _weight=model.model.embed_tokens.weight[:v],
                                       _freeze=True)
        self._lm = types.SimpleNamespace(weight=model.lm_head.weight[:v])

    def get_input_embeddings(self):
        return self._emb

    def get_output_embeddings(self):
        return self._lm

    def parameters(self):
        return self._model.parameters()


def _env_int(name: str, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {v!r}") from None


class JetFlowWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        cfg = resolving_view(server_args)  # the resolved arguments (the plugin's defaults included)
        self.n = int(cfg.speculative_num_draft_tokens)
        # JETFLOW_BUDGET=auto: each round's tree size adapts to acceptance and batch size, up to the budget above
        # (the KV slots SGLang reserves per decode step are sized for it).
        budget_mode = os.environ.get("JETFLOW_BUDGET", "").strip().lower()
        if budget_mode not in ("", "fixed", "auto"):
            raise ValueError(f"JETFLOW_BUDGET must be 'auto' or 'fixed'; got {budget_mode!r}")
        self.adaptive = AdaptiveBudget(max_budget=self.n) if budget_mode == "auto" else None
        self.reqs: dict[str, _Req] = {}

        head_dir = cfg.speculative_draft_model_path
        name = os.environ.get("JETFLOW_DRAFTER") or ("jetflow" if head_dir else "ngram")
        head = None
        if name in HEAD_DRAFTERS:
            if not head_dir:
                raise ValueError(f"JETFLOW drafter {name!r} needs --speculative-draft-model-path (a JetFlow head folder)")
            from ..head import load_head

            model = self.model_runner.model
            view = _TargetView(model, self.model_runner.model_config.hf_config)
            head = load_head(head_dir, view, device=self.device)
            taps = list(head.config.tap_layers)
            if taps != sorted(taps):
                raise ValueError(f"head tap layers must be ascending (SGLang concatenates them in layer order): {taps}")
            n_layers = self.model_runner.model_config.hf_config.num_hidden_layers
            if taps[-1] + 1 >= n_layers:  # SGLang captures *inputs* of layers; the last layer's output is not one
                raise ValueError(f"tap layer {taps[-1]} is the target's last layer; SGLang can capture up to "
                                 f"layer {n_layers - 2}")
            if not hasattr(model, "set_dflash_layers_to_capture"):
                raise ValueError(f"{type(model).__name__} cannot expose hidden states to a draft head in SGLang")
            # capture "before layer l+1" == output of decoder layer l (HF hidden_states[l+1])
            model.set_dflash_layers_to_capture(taps)
        self.drafter = make_drafter(name, head=head, width=_env_int("JETFLOW_WIDTH", 8))
        depth = _env_int("JETFLOW_DEPTH", None)
        if depth is not None and hasattr(self.drafter, "depth"):
            self.drafter.depth = max(1, min(depth, self.drafter.depth))
        self.needs_taps = bool(getattr(self.drafter, "needs_taps", False))
        self.capture = CaptureHiddenMode.FULL if self.needs_taps else None
        # QLEN_ONLY mask for our CPU backend; the FULL layout for SGLang's GPU custom-mask backends.
        self.full_mask = self.device != "cpu" and str(self.device) != "cpu"
        logger.info("JETFLOW worker: drafter=%s budget=%d width=%s depth=%s", name, self.n,
                    getattr(self.drafter, "width", "-"), getattr(self.drafter, "depth", "-"))

    # -- BaseSpecWorker plumbing ------------------------------------------------------------------------------
    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        # the target pools exist only now; the head keeps its own context K/V outside them
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        self.reqs.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.reqs.pop(rid, None)

    # -- one scheduler step ------------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self._verify(batch, on_publish)
        res = self.target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors,
                                                          capture_hidden_mode=self.capture)
        bs = len(batch.reqs)
        if self.needs_taps and batch.forward_mode.is_extend() and bs:
            self._keep_prefill_taps(batch, res.logits_output.hidden_states)
        new_seq_lens = batch.seq_lens.clone()
        accept_tokens = torch.zeros(bs, self.n, dtype=torch.int32, device=self.device)
        if bs:
            accept_tokens[:, 0] = res.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=res.logits_output, next_token_ids=res.next_token_ids,
            can_run_cuda_graph=res.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=self._carry(new_seq_lens, accept_tokens.flatten(), accept_lens),
            speculative_num_draft_tokens=self.n)

    def _carry(self, new_seq_lens, accept_tokens, accept_lens, n=None):
        return JetFlowVerifyInput(draft_token_num=n or self.n, new_seq_lens=new_seq_lens, accept_tokens=accept_tokens,
                                  accept_lens=accept_lens)

    def _keep_prefill_taps(self, batch, hidden):
        if hidden is None:
            raise RuntimeError("the target returned no hidden states; its model class does not capture tap layers")
        off = 0
        for req, prefix_len, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            r = self.reqs.get(req.rid)
            if r is None or prefix_len == 0:  # new, or re-prefilled after a retraction: start over
                self.reqs.pop(req.rid, None)
                r = self.reqs[req.rid] = _Req()
            r.taps.append(hidden[off: off + ext])
            off += ext
        # A request that finishes at prefill (max_tokens=1, abort) never decodes; keep the oldest pending bounded.
        pending = [rid for rid, r in self.reqs.items() if r.state is None]
        for rid in pending[: max(0, len(pending) - 4 * self.model_runner.max_running_requests - 16)]:
            del self.reqs[rid]

    def _request(self, req, seq_len: int) -> _Req:
        r = self.reqs.get(req.rid)
        if r is None:
            if self.needs_taps:
                raise RuntimeError(f"request {req.rid} reached decode without its prefill taps")
            r = self.reqs[req.rid] = _Req()
        if r.state is None:
            ctx = (list(req.origin_input_ids) + list(req.output_ids))[:seq_len]
            taps = torch.cat(r.taps) if r.taps else None
            if taps is not None and taps.shape[0] != seq_len:
                raise RuntimeError(f"request {req.rid}: {taps.shape[0]} tap rows for {seq_len} committed tokens")
            r.state, r.taps = self.drafter.new_state(ctx, taps), []
            seed = req.sampling_params.sampling_seed
            r.generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        return r

    @torch.no_grad()
    def _verify(self, batch, on_publish) -> GenerationBatchResult:
        bs = len(batch.reqs)
        n = self.adaptive.choose(bs) if self.adaptive else self.n
        t0 = time.perf_counter()
        seq_lens = batch.seq_lens.tolist()
        info = batch.sampling_info
        temps = info.temperatures.view(-1).tolist()
        top_ks, top_ps = info.top_ks.view(-1).tolist(), info.top_ps.view(-1).tolist()
        greedy = [k == 1 for k in top_ks]  # SGLang turns temperature 0 into top_k=1

        states, trees = [], []
        for i, req in enumerate(batch.reqs):
            r = self._request(req, seq_lens[i])
            states.append(r)
            anchor = int(req.output_ids[-1])
            try:
                trees.append(self.drafter.draft(r.state, anchor, n, temperature=0.0 if greedy[i] else temps[i],
                                                generator=r.generator))
            except Exception:  # a drafting bug must not take the server down: verify the root alone (plain decode)
                logger.exception("JETFLOW drafter failed for request %s; decoding this round without a draft", req.rid)
                trees.append(DraftTree.root(anchor))

        t1 = time.perf_counter()
        tokens, mask, positions, r_index, r_next, r_sib = pack_trees(trees, n, seq_lens, self.full_mask, self.device)
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
        out = res.logits_output
        logits = self._adjust(out.next_token_logits, info, n)
        t2 = time.perf_counter()
        if batch.has_grammar:  # constrained decoding: mask every node's logits with the grammar state along its path
            from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

            tree = GrammarTree.from_host(r_next.cpu(), r_sib.cpu(), tokens.cpu().view(bs, n))
            grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=tree, sampling_info=info,
                                                    device=self.device, barrier=None)
            if grammar_mask is not None:
                logits = logits.clone() if logits is out.next_token_logits else logits
                grammar_mask.apply(logits)

        # acceptance: the core's rules, per request, on the real (unpadded) tree
        predict = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, n), -1, dtype=torch.int32)
        accept_lens = torch.empty(bs, dtype=torch.int32)
        argmax = logits.argmax(-1).view(bs, n).tolist()
        for i, (tree, r) in enumerate(zip(trees, states)):
            m = len(tree)
            if greedy[i]:
                path, bonus = greedy_accept(tree, argmax[i][:m])
            else:
                k = top_ks[i] if 0 < top_ks[i] < logits.shape[-1] else 0
                probs = process_logits(logits[i * n: i * n + m], temps[i], k, top_ps[i]).cpu()
                path, bonus = sample_accept(tree, probs, r.generator)
            nxt = [tree.tokens[p] for p in path[1:]] + [bonus]
            for j, (node, tok) in enumerate(zip(path, nxt)):
                accept_index[i, j] = i * n + node
                predict[i * n + node] = tok
            accept_lens[i] = len(path)
            if self.adaptive:
                self.adaptive.observe(path, m, bs, verify_s=t2 - t1, draft_s=(t1 - t0) / bs)
            taps = out.hidden_states[i * n + torch.tensor(path, device=out.hidden_states.device)] \
                if self.needs_taps else None
            self.drafter.advance(r.state, [tree.tokens[p] for p in path], taps)

        predict, accept_index, accept_lens = (t.to(self.device) for t in (predict, accept_index, accept_lens))
        move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        if batch.return_logprob:
            from sglang.srt.layers.logprob_processor import compute_spec_logprobs

            compute_spec_logprobs(batch, out, predict, accept_index=accept_index)
        new_seq_lens = batch.seq_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        accept_tokens = predict[accept_index].flatten()  # -1 slots read garbage the scheduler never looks at
        return GenerationBatchResult(
            logits_output=out, next_token_ids=accept_tokens, can_run_cuda_graph=res.can_run_cuda_graph,
            accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            next_draft_input=self._carry(new_seq_lens, accept_tokens, accept_lens, n),
            speculative_num_draft_tokens=n)

    def _adjust(self, logits, info, n):
        """The logit edits SGLang applies before its own verify (penalties, logit_bias), per node."""
        if info.acc_additive_penalties is not None:
            logits = logits + info.acc_additive_penalties.repeat_interleave(n, 0)
        if info.acc_scaling_penalties is not None:
            from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

            logits = logits.clone()
            apply_scaling_penalties(logits, info.acc_scaling_penalties.repeat_interleave(n, 0))
        if info.logit_bias is not None:
            logits = logits + info.logit_bias.repeat_interleave(n, 0)
        return logits
