"""Drafters turn the committed context into a token tree. They hold no per-request state: the caller keeps the
state object, so one drafter serves many requests (the SGLang worker keys states by request id).

    state = drafter.new_state(prompt_ids, taps)
    tree = drafter.draft(state, anchor, budget, temperature, generator)
    drafter.advance(state, committed_tokens, committed_taps)   # root + accepted nodes

Head drafters also draft a whole batch in one head forward (topk_batch / draft_batch on padded context K/V), and their
single-request `draft` is that same path with b = 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from jetflow_sglang.core import rowgemm
from jetflow_sglang.draft.context_kv import ContextKV
from jetflow_sglang.head import MASK, JetFlowHead
from jetflow_sglang.core.lookup_batch import merge_lookup
from jetflow_sglang.draft.registry import DEFAULT_WIDTH, DRAFTERS, TREES, spec
from jetflow_sglang.core.tree import DraftTree, best_first, check_budget, merge, per_depth
from jetflow_sglang.core.tree_batch import TreeBatch, build_topb, build_topb_conditioned, root_only, topb_depth

# A request's next tree at budget B runs the levels its last tree at B reached plus this margin (a causal head's first
# d levels are exact on their own, and the head forward and the vocabulary projection cost grows with the rows). A tree
# that reaches the last level run is redrafted with every level, so every tree is exactly the one the full block
# gives: by the builder's tie rule (score, then depth) a node deeper than d never outranks its depth-d ancestor, so a
# top-B tree without a depth-d node has none deeper either. At B=16 the SmolLM2 head's trees reach depth 2-5 of 15.
HORIZON_MARGIN = 2


@dataclass
class State:
    tokens: list[int]  # committed tokens; the head's context rows when it has one
    ctx: ContextKV | None = None  # the head's context K/V (b = 1), grown in place
    extra: dict = field(default_factory=dict)
    # committed tap rows not yet projected into `ctx`: plain-decoding rounds (budget 1) only queue them, and the
    # next head forward projects them all at once, so a budget-1 round costs what a plain decoding step costs
    pending: list = field(default_factory=list)


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs_taps: bool

    def new_state(self, prompt_ids, taps=None) -> State: ...

    def draft(self, state: State, anchor: int, budget: int, temperature: float = 0.0, generator=None) -> DraftTree: ...

    def advance(self, state: State, tokens, taps=None) -> None: ...


class ARDrafter:
    """No draft at all: the tree is the root, so each verify step is one autoregressive step."""
    name = "ar"
    needs_taps = False

    def new_state(self, prompt_ids, taps=None) -> State:
        return State(tokens=list(prompt_ids))

    def advance(self, state: State, tokens, taps=None) -> None:
        state.tokens.extend(int(t) for t in tokens)

    def draft(self, state, anchor, budget, temperature=0.0, generator=None) -> DraftTree:
        check_budget(budget)
        return DraftTree.root(anchor)


class NgramDrafter(ARDrafter):
    """Prompt lookup: continuations of earlier occurrences of the context's last n-gram, merged into a trie."""
    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1, max_depth: int = 15, max_matches: int = 8):
        self.n_max, self.n_min, self.max_depth, self.max_matches = n_max, n_min, max_depth, max_matches

    def draft(self, state, anchor, budget, temperature=0.0, generator=None) -> DraftTree:
        check_budget(budget)
        seq = state.tokens + [int(anchor)]
        tree, index = DraftTree.root(anchor), {}
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            suffix, found = seq[-n:], 0
            for start in range(len(seq) - n - 1, -1, -1):  # most recent first
                if seq[start:start + n] != suffix:
                    continue
                node = 0
                for tok in seq[start + n:start + n + self.max_depth]:
                    if len(tree) >= budget and (node, tok) not in index:
                        break
                    if (node, tok) not in index:
                        index[(node, tok)] = tree.add(tok, node, tree.logps[node] - 1.0 / n)
                    node = index[(node, tok)]
                found += 1
                if found >= self.max_matches or len(tree) >= budget:
                    break
            if len(tree) >= budget:
                break
        return tree

    def merge_batch(self, tb: TreeBatch, history: torch.Tensor, lens: torch.Tensor, budget: int) -> TreeBatch:
        """Each request's trie merged into its greedy tree of a batch, on the trees' device: tree.merge([tree, draft])
        node for node (lookup_batch.merge_lookup). history [b, L] holds each request's committed tokens before its
        anchor in [:, :lens[i]]; root-only trees give the tries alone, best-first."""
        return merge_lookup(tb, history, lens, budget, self.n_max, self.n_min, self.max_depth, self.max_matches)


class HeadDrafter:
    """Drafts with a JetFlow head. mode: 'tree' (per-depth marginals, top-B tree), 'branch' (every node re-conditioned
    on its real ancestors, then rebuilt per parent), 'chain' (argmax per depth: DFlash). tree: 'exact' (the vectorized
    top-B builder, tree_batch) or 'paper' (the paper's eager accum_logp form, built on the host)."""
    needs_taps = True

    def __init__(self, head: JetFlowHead, mode: str = "tree", width: int = DEFAULT_WIDTH, tree: str = "exact",
                 name: str = "", depth: int | None = None, scores: bool = True):
        if mode not in ("tree", "branch", "chain"):
            raise ValueError(f"unknown head drafting mode {mode!r}")
        if tree not in TREES:
            raise ValueError(f"tree must be one of {', '.join(TREES)}; got {tree!r}")
        if not head.bound:
            raise ValueError("bind the head to its target first (load_head(dir, target))")
        block = head.config.block_size - 1
        if depth is not None and not (isinstance(depth, int) and 1 <= depth <= block):
            raise ValueError(f"depth must be an integer in [1, {block}] (the head's block); got {depth!r}")
        if not (isinstance(width, int) and width >= 1):
            raise ValueError(f"width must be a positive integer; got {width!r}")
        self.head, self.mode, self.tree_kind = rowgemm.enable(head), mode, tree  # multi-row GEMMs as W @ X^T on CPU
        self.name = name or mode
        self.block = block  # mask slots per forward (the trained block)
        self.depth = depth or block  # deepest drafted level
        self.lm_weight = head.lm_weight().detach().contiguous()  # gathered once for a reduced vocab
        self.kv_weight = head.fused_kv_weight()  # the context rows' K/V of every layer in one GEMM
        self.fused = [layer.fused_weights() for layer in head.layers]  # q|k|v and gate|up: one GEMM each per layer
        self.vocab_ids = head.vocab_ids
        self.vocab_size = head.config.target["vocab_size"]
        self.width = min(width, self.vocab_ids.shape[0])
        self.device = self.lm_weight.device
        # A chain's cumulative log-probs rank it against prompt-lookup nodes and show in the explorer; a server
        # chain without lookup needs only the argmax per depth (one max over the vocabulary, no log-softmax and
        # top-k), and its scores are then NaN.
        self.scores = scores
        self.runner = None  # a core.graphs.GraphRunner: the tree build replayed from its capture per shape
        # the engine's `draft` reads its context paged (draft/paged.py, the Triton kernel), so that the head forward
        # replays from its capture too (a GPU, or TRITON_INTERPRET=1); the server passes its own paged contexts
        self.paged = False

    def gemm_weights(self) -> list[torch.Tensor]:
        """Every weight the head multiplies rows by (the fused ones included): what rowgemm.tune measures."""
        own = [p for p in self.head.parameters() if p.dim() == 2]
        return own + [self.lm_weight, self.kv_weight] + [w for pair in self.fused for w in pair]

    @property
    def eager(self) -> bool:
        return self.tree_kind == "paper"

    @property
    def truncates(self) -> bool:
        """Whether `draft` may run fewer levels than the budget allows (see HORIZON_MARGIN): a causal head's first d
        levels are exact on their own; a bidirectional block and a chain (which uses every level) always run whole."""
        return self.head.config.causal and self.mode != "chain"

    # -- context ---------------------------------------------------------------------------------------------
    def context_kv(self, taps, start) -> list:
        """taps [b, m, n_taps*H] (or [m, ...]) at positions start + (0..m-1) -> per-layer (k, v) [b, Hkv, m, D]."""
        taps = torch.as_tensor(taps).to(self.device)
        if taps.dim() == 2:
            taps = taps[None]
        start = torch.as_tensor(start, device=self.device).view(-1, 1)
        pos = start + torch.arange(taps.shape[1], device=self.device)
        return self.head.context_kv(taps, pos.expand(taps.shape[0], -1), self.kv_weight)

    @torch.no_grad()
    def new_state(self, prompt_ids, taps) -> State:
        return State(tokens=list(prompt_ids), ctx=ContextKV(self.context_kv(taps, 0)))

    @torch.no_grad()
    def advance(self, state: State, tokens, taps) -> None:
        """Queue the committed rows; their K/V is appended in place (O(new tokens)) before the next head forward."""
        tokens = [int(t) for t in tokens]
        if tokens:
            state.pending.append(torch.as_tensor(taps)[: len(tokens)])
            state.tokens.extend(tokens)

    def _flush(self, state: State) -> None:
        if state.pending:
            rows = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
            state.ctx.append(self.context_kv(rows, len(state.tokens) - rows.shape[0]), [rows.shape[0]])
            state.pending.clear()

    # -- batched forwards ------------------------------------------------------------------------------------
    def _mask(self, ctx_kv, ctx_lens: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
        """The head's attention mask from the block's own [b, S, S]: over padded context K/V, [b, S, T + S] (row t of
        request i visible iff t < ctx_lens[i]); a paged context (sglang/head_pool.PagedContext) applies the lengths
        itself and takes the block's mask alone."""
        if getattr(ctx_kv, "paged", False):
            return inner
        b, rows, _ = inner.shape
        t = ctx_kv[0][0].shape[2]
        seen = (torch.arange(t, device=self.device)[None] < ctx_lens[:, None])[:, None].expand(-1, rows, t)
        return torch.cat([seen, inner], 2)

    def _logits(self, tokens, positions, mask, ctx_kv, rows: slice) -> torch.Tensor:
        """Draft logits of the slots in `rows` (the vocabulary projection runs on those rows only)."""
        hidden = self.head(tokens, positions, ctx_kv, mask, self.fused)[:, rows]
        return self.head.logits(hidden, self.lm_weight)

    def _logprobs(self, tokens, positions, mask, ctx_kv, rows: slice) -> torch.Tensor:
        return self._logits(tokens, positions, mask, ctx_kv, rows).float().log_softmax(-1)

    def levels(self, budget: int) -> int:
        """Depths a tree of `budget` nodes can use: a causal head's first d levels don't see later MASK slots, so a
        forward over [anchor, MASK x d] gives them exactly; a bidirectional tree's block needs all its slots (a chain's
        block is the chain: block_logprobs_batch)."""
        return max(1, min(self.depth, budget - 1))

    def block_rows(self, budget: int) -> int:
        """Rows of head_batch's forward at this budget (the anchor and its MASK slots)."""
        return 1 + (self.levels(budget) if self.head.config.causal or self.mode == "chain" else self.block)

    @torch.no_grad()
    def block_logprobs_batch(self, anchors, ctx_kv, ctx_lens, depth: int | None = None,
                             logits: bool = False) -> torch.Tensor:
        """One forward over [anchor, MASK x block] per request: log-probs [b, depth, V_draft] for depths 1..depth
        (logits=True: the raw logits, in the head's dtype).

        ctx_kv: per head layer (k, v) [b, Hkv, T, D], padded, row t of request i valid iff t < ctx_lens[i]; or a
        paged context (sglang/head_pool.PagedContext) with room for block_rows past every request.
        depth (default self.depth): a causal head runs only [anchor, MASK x depth], cheaper for small budgets; so does
        a chain (the dflash drafter), whose block is the chain's length, as in SGLang's DFLASH and DFlash's engine
        (block = draft tokens), so that it drafts exactly what they draft."""
        anchors = torch.as_tensor(anchors, device=self.device).view(-1)
        ctx_lens = torch.as_tensor(ctx_lens, device=self.device).view(-1)
        depth = min(depth or self.depth, self.depth)
        slots = depth if self.head.config.causal or self.mode == "chain" else self.block
        b, size = anchors.shape[0], slots + 1
        tokens = torch.cat([anchors[:, None], torch.full((b, slots), MASK, device=self.device)], 1)
        pos = ctx_lens[:, None] + torch.arange(size, device=self.device)
        mask = self._mask(ctx_kv, ctx_lens, self.head.block_mask(0, size, device=self.device)[None].expand(b, -1, -1))
        return (self._logits if logits else self._logprobs)(tokens, pos, mask, ctx_kv, slice(1, 1 + depth))

    @torch.no_grad()
    def conditioned_logprobs_batch(self, tb: TreeBatch, ctx_kv, ctx_lens) -> torch.Tensor:
        """Child distribution of every slot given its real ancestors, in one forward: [b, N, V_draft].

        Node slots carry their real tokens at position ctx + depth and see their ancestors; one MASK query per node,
        at ctx + depth + 1, sees that node's path. This is a training-time block with real tokens before the first MASK.
        """
        ctx_lens = torch.as_tensor(ctx_lens, device=self.device).view(-1)
        ctx_kv = _padded(ctx_kv)  # 2N block rows: more than a paged context reserves past each request
        b, n = tb.batch, tb.budget
        anc = tb.ancestor_mask()
        eye = torch.eye(n, dtype=torch.bool, device=self.device).expand(b, n, n)
        inner = torch.cat([torch.cat([anc, torch.zeros_like(anc)], 2), torch.cat([anc, eye], 2)], 1)
        mask = self._mask(ctx_kv, ctx_lens, inner)
        pos = ctx_lens[:, None] + torch.cat([tb.depths, tb.depths + 1], 1)
        tokens = torch.cat([tb.tokens, torch.full_like(tb.tokens, MASK)], 1)
        return self._logprobs(tokens, pos, mask, ctx_kv, slice(n, None))

    def _topk(self, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vals, idx = lp.topk(self.width, -1)
        return self.vocab_ids[idx], vals

    @torch.no_grad()
    def topk_batch(self, anchors, ctx_kv, ctx_lens, depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [b, depth, W], logps [b, depth, W]): the head's top-W per depth, sorted descending."""
        return self._topk(self.block_logprobs_batch(anchors, ctx_kv, ctx_lens, depth))

    @torch.no_grad()
    def draft_batch(self, anchors, ctx_kv, ctx_lens, budget: int) -> TreeBatch:
        """Greedy (deterministic) trees for a batch: one head forward (two for 'branch'), no host sync ('exact')."""
        check_budget(budget)
        anchors = torch.as_tensor(anchors, device=self.device).view(-1)
        if budget == 1:  # plain decoding: no head forward at all
            return root_only(anchors, 1)
        return self.tree_batch(anchors, self.head_batch(anchors, ctx_kv, ctx_lens, budget), ctx_kv, ctx_lens, budget)

    def head_batch(self, anchors, ctx_kv, ctx_lens, budget: int, depth: int | None = None) -> torch.Tensor:
        """draft_batch's head forward (budget > 1): log-probs [b, depth, V_draft] (depth: default all the budget
        uses); a chain's raw logits. Over a paged context (draft/paged.py: the pool read in place) every shape is
        fixed by the batch, the block and the table, so with a runner it replays from one capture per key; padded
        rows write their block to slot 0 (padding)."""
        depth, logits = depth or self.levels(budget), self.mode == "chain"
        if self.runner is None or not getattr(ctx_kv, "paged", False):
            return self.block_logprobs_batch(anchors, ctx_kv, ctx_lens, depth, logits=logits)

        def head(anchors, table, lens, block_slots, ctx_lens):
            return (self.block_logprobs_batch(anchors, ctx_kv.like(table, lens, block_slots), ctx_lens, depth,
                                              logits=logits),)

        anchors = torch.as_tensor(anchors, device=self.device).view(-1)
        pool = ctx_kv.pool
        key = (budget, depth, ctx_kv.rows, ctx_kv.table.shape[1], str(pool.k[0].dtype), f"pool{pool.serial}")
        return self.runner.run("head", key, head, anchors, *ctx_kv.tensors, ctx_lens, fill={3: 0})[0]

    @torch.no_grad()
    def tree_batch(self, anchors, out, ctx_kv, ctx_lens, budget: int) -> TreeBatch:
        """draft_batch's trees from head_batch's output (a 'branch' tree runs its second head forward here)."""
        if self.mode == "chain":  # the first maximal index per depth, as DFLASH's argmax, from the raw logits
            vals, idx = out.max(-1)
            lps = vals.float() - out.float().logsumexp(-1) if self.scores else vals.float().fill_(math.nan)
            return _chain_batch(anchors, self.vocab_ids[idx], lps, budget)
        return self._trees(anchors, out, ctx_kv, ctx_lens, budget)

    def _trees(self, anchors, lp, ctx_kv, ctx_lens, budget: int) -> TreeBatch:
        if self.mode == "chain":  # from log-probs (the host drafting loop's path)
            vals, idx = lp.max(-1)
            return _chain_batch(anchors, self.vocab_ids[idx], vals, budget)
        if self.runner is not None and self.mode == "tree" and not self.eager:  # captured: one piece per shape
            def topb(anchors, lp):
                tb = build_topb(anchors, *self._topk(lp), budget)
                return tb.tokens, tb.parents, tb.depths, tb.logps, tb.sizes

            fields = self.runner.run("tree", (budget, *lp.shape[1:], str(lp.dtype)), topb, anchors, lp)
            return TreeBatch(*fields, topb_depth(budget, lp.shape[1], self.width, lp.device))
        toks, lps = self._topk(lp)
        if self.eager:
            return self._host_trees(anchors, toks, lps, _padded(ctx_kv), ctx_lens, budget)
        tb = build_topb(anchors, toks, lps, budget)
        if self.mode == "branch":
            c_toks, c_lps = self._topk(self.conditioned_logprobs_batch(tb, ctx_kv, ctx_lens))
            tb = build_topb_conditioned(tb, c_toks, c_lps, toks, lps, budget)
        return tb

    def _host_trees(self, anchors, toks, lps, ctx_kv, ctx_lens, budget) -> TreeBatch:
        """The paper's eager form (tree='paper'), one request at a time on the host."""
        trees = []
        for i, anchor in enumerate(anchors.tolist()):
            t_i, l_i = toks[i].tolist(), lps[i].tolist()
            tree = best_first(anchor, per_depth(t_i, l_i), budget, self.width, toks.shape[1], eager=True)
            if self.mode == "branch" and len(tree) > 1:
                first = TreeBatch.from_trees([tree], device=self.device)
                c_lp = self.conditioned_logprobs_batch(first, [(k[i:i + 1], v[i:i + 1]) for k, v in ctx_kv],
                                                       ctx_lens[i:i + 1])[0]
                c_t, c_l = (x.tolist() for x in self._topk(c_lp))
                tree = _rebuild_host(tree, c_t, c_l, t_i, l_i, budget, self.width, toks.shape[1], eager=True)
            trees.append(tree)
        return TreeBatch.from_trees(trees, budget, self.device)

    # -- single request (the batched path with b = 1) --------------------------------------------------------
    def context(self, state: State) -> list:
        """Per-layer (k, v) [1, Hkv, T, D] views of the request's whole committed context (queued rows projected)."""
        self._flush(state)
        return state.ctx.views()

    def _one(self, state: State, rows: int = 0):
        """(the request's context, its length): padded views, or with rows > 0 a paged one with room for a block of
        that many rows (self.paged: what a captured head forward reads)."""
        if rows:
            self._flush(state)
            return state.ctx.paged(rows), torch.tensor([len(state.tokens)], device=self.device)
        return self.context(state), torch.tensor([len(state.tokens)], device=self.device)

    @torch.no_grad()
    def block_logprobs(self, state: State, anchor: int) -> torch.Tensor:
        """[depth, V_draft] log-probs of one request (see block_logprobs_batch)."""
        return self.block_logprobs_batch([int(anchor)], *self._one(state))[0]

    @torch.no_grad()
    def conditioned_logprobs(self, state: State, tree: DraftTree) -> torch.Tensor:
        """[N, V_draft]: every node's child distribution given its real ancestors (see conditioned_logprobs_batch)."""
        return self.conditioned_logprobs_batch(TreeBatch.from_trees([tree], device=self.device), *self._one(state))[0]

    @torch.no_grad()
    def draft(self, state: State, anchor: int, budget: int, temperature: float = 0.0, generator=None) -> DraftTree:
        check_budget(budget)
        if budget == 1:  # plain decoding: no head forward
            return DraftTree.root(anchor)
        ctx_kv, lens = self._one(state, self.block_rows(budget) if self.paged else 0)
        anchors = torch.tensor([int(anchor)], device=self.device)
        full = self.levels(budget)
        horizons = state.extra.setdefault("horizon", {})
        levels = min(full, horizons.get(budget, full)) if self.truncates else full
        while True:  # at most twice: a tree that reaches the last level run is redrafted with every level
            lp = self.head_batch(anchors, ctx_kv, lens, budget, levels) if self.mode != "chain" else \
                self.block_logprobs_batch(anchors, ctx_kv, lens, levels)
            # Sampling: the shape comes from the greedy marginal tree and is fixed before any token is drawn.
            shape = self._trees(anchors, lp, ctx_kv, lens, budget) if temperature <= 0 or self.mode == "chain" \
                or self.eager else build_topb(anchors, *self._topk(lp), budget)
            reached = int(shape.depths[0, :int(shape.sizes[0])].max())
            if levels >= full or reached < levels:
                break
            levels = full
        horizons[budget] = reached + HORIZON_MARGIN
        if temperature <= 0:
            return shape.tree(0)
        q = [self._dense(qd) for qd in (lp[0] / temperature).softmax(-1)]
        tree = resample(shape.tree(0), q, generator)
        if self.mode == "branch" and len(tree) > 1:
            tree = self._resample_conditioned(tree, q, ctx_kv, lens, temperature, generator)
        return tree

    def _resample_conditioned(self, first: DraftTree, q_marginal, ctx_kv, lens, temperature, generator) -> DraftTree:
        """Branch conditioning at T > 0: draw each node's children from its own conditioned distribution.

        `first` was drawn from the per-depth marginals. One forward gives every node of `first` its distribution given
        its real path. The final tree has first's shape and first's depth-1 tokens (drawn from the root's marginal,
        which the root keeps as its q); every other node draws its children afresh, without replacement, from the
        conditioned distribution of its own token path when `first` holds that path, else from its depth's marginal.
        Each node's q is fixed before its children are drawn, so recursive rejection sampling stays lossless.
        """
        c_lp = self.conditioned_logprobs_batch(TreeBatch.from_trees([first], device=self.device), ctx_kv, lens)[0]
        known = {(first.parents[v], first.tokens[v]): v for v in range(1, len(first))}
        n = len(first)
        out = DraftTree(tokens=list(first.tokens), parents=list(first.parents), depths=list(first.depths),
                        logps=list(first.logps), child_probs=[None] * n)
        out.child_probs[0] = q_marginal[0]
        source = [-1] * n  # the node of `first` with the same token path, or -1
        source[0] = 0
        for kid in first.children(0):  # depth 1 keeps first's draws from the root's marginal
            source[kid] = kid
        for node in range(1, n):  # parents come before children
            kids = first.children(node)
            if not kids:
                continue
            src = source[node]
            q = self._dense((c_lp[src] / temperature).softmax(-1)) if src >= 0 else q_marginal[first.depths[node]]
            out.child_probs[node] = q
            gumbel = -torch.empty_like(q).exponential_(generator=generator).log()
            for kid, tok in zip(kids, (q.log() + gumbel).topk(len(kids)).indices.tolist()):
                out.tokens[kid] = tok
                out.logps[kid] = out.logps[node] + math.log(max(float(q[tok]), 1e-30))
                source[kid] = known.get((src, tok), -1) if src >= 0 else -1
        return out

    def _dense(self, q_draft: torch.Tensor) -> torch.Tensor:
        q = torch.zeros(self.vocab_size, dtype=torch.float32)
        q[self.vocab_ids.cpu()] = q_draft.float().cpu()
        return q


class WithLookup:
    """A head drafter whose greedy trees also hold prompt-lookup continuations.

    Each round the head's top-B tree and the n-gram trie (NgramDrafter: the continuations of earlier occurrences of
    the context's last n tokens, scored -1/n per token) compete for the same B nodes on one score, merged by token
    path (tree.merge): text that repeats its context (numbers in a word problem, identifiers in code) is drafted
    deep even where the head is unsure, and the head's tree fills the rest. At temperature > 0 the head's sampled
    tree is used alone (its children are draws from q; deterministic lookup siblings would need their own
    rejection rule), so sampling stays exactly as lossless as the head drafter's."""
    needs_taps = True

    def __init__(self, base: HeadDrafter, lookup: NgramDrafter | None = None):
        self.base, self.lookup = base, lookup or NgramDrafter()
        self.name = f"{base.name}+lookup"

    def new_state(self, prompt_ids, taps=None) -> State:
        return self.base.new_state(prompt_ids, taps)

    def advance(self, state: State, tokens, taps=None) -> None:
        self.base.advance(state, tokens, taps)

    def draft(self, state: State, anchor: int, budget: int, temperature: float = 0.0, generator=None) -> DraftTree:
        tree = self.base.draft(state, anchor, budget, temperature, generator)
        if temperature > 0 or budget == 1:
            return tree
        return merge([tree, self.lookup.draft(state, anchor, budget)], budget)

    def merge_batch(self, tb: TreeBatch, history: torch.Tensor, lens: torch.Tensor, budget: int) -> TreeBatch:
        """`draft`'s merge for a batch of head trees (NgramDrafter.merge_batch)."""
        return self.lookup.merge_batch(tb, history, lens, budget)


def _padded(ctx_kv) -> list:
    """Per-layer padded (k, v) of a context: a paged one (sglang/head_pool.PagedContext) gathered, others as they are."""
    return ctx_kv.padded() if getattr(ctx_kv, "paged", False) else ctx_kv


def _chain_batch(anchors, tokens, logps, budget: int) -> TreeBatch:
    """Linear chains [anchor, argmax at depth 1, 2, ...] of min(budget, depth + 1) nodes, as a TreeBatch."""
    b, depth = tokens.shape
    n = min(budget - 1, depth)
    dev = anchors.device
    out = root_only(anchors, budget)
    out.tokens[:, 1:n + 1] = tokens[:, :n]
    out.parents[:, 1:n + 1] = torch.arange(n, device=dev)
    out.depths[:, 1:n + 1] = torch.arange(1, n + 1, device=dev)
    out.logps[:, 1:n + 1] = logps[:, :n].float().cumsum(1)
    out.sizes[:] = n + 1
    out.max_depth = max(1, n)
    return out


def _rebuild_host(tree, c_toks, c_lps, toks, lps, budget, width, depth, eager=False) -> DraftTree:
    """Host rebuild of a branch tree: known token paths take their conditioned children, others the marginals."""
    known = {tuple(tree.tokens[i] for i in tree.path_to(v)[1:]): v for v in range(len(tree))}

    def child_fn(t: DraftTree, node: int):
        v = known.get(tuple(t.tokens[i] for i in t.path_to(node)[1:]))
        if v is not None:
            return c_toks[v], c_lps[v]
        return toks[t.depths[node]], lps[t.depths[node]]  # a path pass 1 never saw: fall back to marginals

    return best_first(tree.tokens[0], child_fn, budget, width, depth, eager=eager)


def resample(shape: DraftTree, q_by_depth: list[torch.Tensor], generator=None) -> DraftTree:
    """Keep the tree's shape, draw each node's children without replacement from the depth's draft distribution.

    The shape is fixed before any token is drawn, so how many children a node gets never depends on which tokens
    were drawn: that is what keeps recursive rejection sampling lossless.
    """
    out = DraftTree.root(shape.tokens[0])
    out.child_probs = [None]
    new_of = {0: 0}
    for old in range(len(shape)):
        kids = shape.children(old)
        if not kids:
            continue
        q = q_by_depth[shape.depths[old]]
        gumbel = -torch.empty_like(q).exponential_(generator=generator).log()
        draws = (q.log() + gumbel).topk(len(kids)).indices.tolist()
        out.child_probs[new_of[old]] = q
        for kid, tok in zip(kids, draws):
            new_of[kid] = out.add(tok, new_of[old], out.logps[new_of[old]] + math.log(max(float(q[tok]), 1e-30)))
            out.child_probs.append(None)
    return out


def make_drafter(name: str, head: JetFlowHead | None = None, bidir_head: JetFlowHead | None = None,
                 width: int = DEFAULT_WIDTH, tree: str = "exact", depth: int | None = None,
                 lookup: bool = False) -> Drafter:
    """jetflow: causal head + top-B tree; jetflow-branch: causal head, branch-conditioned; ddtree: bidirectional
    head + top-B tree; dflash: bidirectional head, linear chain; ngram: prompt lookup; ar: no drafting.
    tree: 'exact' (default: the exact top-B builder) or 'paper' (the paper's eager form); depth: deepest level;
    lookup: merge prompt-lookup continuations into a head drafter's greedy trees (WithLookup)."""
    if tree not in TREES:
        raise ValueError(f"tree must be one of {', '.join(TREES)}; got {tree!r}")
    row = spec(name)  # an unknown name: the registry's one-line error with every name
    if name == "ar":  # no head: nothing to merge a lookup trie into (ngram is prompt lookup itself)
        return ARDrafter()
    if name == "ngram":
        return NgramDrafter()
    h = head if row.head == "causal" else (bidir_head or head)
    if h is None:
        raise ValueError(f"drafter {name!r} needs a draft head")
    drafter = HeadDrafter(h, mode=row.mode, width=width, tree=tree, name=name, depth=depth)
    return WithLookup(drafter) if lookup else drafter
