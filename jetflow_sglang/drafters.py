"""Drafters turn the committed context into a token tree. They hold no per-request state: the caller keeps the
state object, so one drafter serves many requests (the SGLang worker keys states by request id).

    state = drafter.new_state(prompt_ids, taps)
    tree = drafter.draft(state, anchor, budget, temperature, generator)
    drafter.advance(state, committed_tokens, committed_taps)   # root + accepted nodes
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .head import MASK, JetFlowHead
from .tree import DraftTree, best_first, chain, check_budget, per_depth


@dataclass
class State:
    tokens: list[int]  # committed tokens; the head's context rows when it has one
    ctx_kv: list | None = None
    extra: dict = field(default_factory=dict)


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


class HeadDrafter:
    """Drafts with a JetFlow head. mode: 'tree' (per-depth marginals, best-first), 'branch' (every node re-conditioned
    on its real ancestors, then rebuilt per parent), 'chain' (argmax per depth: DFlash)."""
    needs_taps = True

    def __init__(self, head: JetFlowHead, mode: str = "tree", width: int = 8, eager: bool = True, name: str = ""):
        if mode not in ("tree", "branch", "chain"):
            raise ValueError(f"unknown head drafting mode {mode!r}")
        if not head.bound:
            raise ValueError("bind the head to its target first (load_head(dir, target))")
        self.head, self.mode, self.width, self.eager = head, mode, width, eager
        self.name = name or mode
        self.depth = head.config.block_size - 1
        self.lm_weight = head.lm_weight().detach().contiguous()  # gathered once for a reduced vocab
        self.vocab_ids = head.vocab_ids
        self.vocab_size = head.config.target["vocab_size"]
        self.device = self.lm_weight.device

    # -- context ---------------------------------------------------------------------------------------------
    def _kv(self, taps, start: int):
        taps = torch.as_tensor(taps).to(self.device)
        pos = torch.arange(start, start + taps.shape[0], device=self.device)[None]
        return self.head.context_kv(taps[None], pos)

    @torch.no_grad()
    def new_state(self, prompt_ids, taps) -> State:
        return State(tokens=list(prompt_ids), ctx_kv=self._kv(taps, 0))

    @torch.no_grad()
    def advance(self, state: State, tokens, taps) -> None:
        new = self._kv(taps, len(state.tokens))
        state.ctx_kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(state.ctx_kv, new)]
        state.tokens.extend(int(t) for t in tokens)

    def _logprobs(self, tokens, positions, mask, state: State) -> torch.Tensor:
        t = torch.tensor(tokens, device=self.device)[None]
        hidden = self.head(t, positions[None].to(self.device), state.ctx_kv, mask[None].to(self.device))[0]
        return self.head.logits(hidden, self.lm_weight).float().log_softmax(-1)

    # -- drafting --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def block_logprobs(self, state: State, anchor: int) -> torch.Tensor:
        """One forward over [anchor, MASK x (B-1)]: log-probs [B-1, V_draft] for depths 1..B-1."""
        n_ctx, size = len(state.tokens), self.depth + 1
        pos = torch.arange(n_ctx, n_ctx + size)
        lp = self._logprobs([anchor] + [MASK] * self.depth, pos, self.head.block_mask(n_ctx, size), state)
        return lp[1:]

    @torch.no_grad()
    def conditioned_logprobs(self, state: State, tree: DraftTree) -> torch.Tensor:
        """Child distribution of every node given its real ancestors, in one forward: [N, V_draft].

        Node slots carry their real tokens at position ctx + depth and see their ancestors; one MASK query per node,
        at ctx + depth + 1, sees that node's path. This is a training-time block with real tokens before the first MASK.
        """
        n_ctx, n = len(state.tokens), len(tree)
        anc = tree.ancestor_mask()
        depths = torch.tensor(tree.depths)
        inner = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
        inner[:n, :n] = anc
        inner[n:, :n] = anc
        inner[n:, n:] = torch.eye(n, dtype=torch.bool)
        mask = torch.cat([torch.ones(2 * n, n_ctx, dtype=torch.bool), inner], 1)
        pos = n_ctx + torch.cat([depths, depths + 1])
        return self._logprobs(tree.tokens + [MASK] * n, pos, mask, state)[n:]

    def _topk(self, lp: torch.Tensor):
        vals, idx = lp.topk(min(self.width, lp.shape[-1]), -1)
        return self.vocab_ids[idx].tolist(), vals.tolist()

    def draft(self, state: State, anchor: int, budget: int, temperature: float = 0.0, generator=None) -> DraftTree:
        check_budget(budget)
        lp = self.block_logprobs(state, anchor)
        if self.mode == "chain":
            vals, idx = lp[: budget - 1].max(-1)
            tree = chain(anchor, self.vocab_ids[idx].tolist(), vals.tolist())
        else:
            toks, lps = self._topk(lp)
            tree = best_first(anchor, per_depth(toks, lps), budget, self.width, self.depth, self.eager)
            if self.mode == "branch" and len(tree) > 1:
                tree = self._rebuild(state, anchor, tree, toks, lps, budget)
        if temperature > 0:
            q = (lp / temperature).softmax(-1)  # log_softmax only shifts logits, so this is softmax(logits / T)
            tree = resample(tree, [self._dense(qd) for qd in q], generator)
        return tree

    def _rebuild(self, state, anchor, tree, toks, lps, budget) -> DraftTree:
        c_toks, c_lps = self._topk(self.conditioned_logprobs(state, tree))
        known = {tuple(tree.tokens[i] for i in tree.path_to(v)[1:]): v for v in range(len(tree))}

        def child_fn(t: DraftTree, node: int):
            v = known.get(tuple(t.tokens[i] for i in t.path_to(node)[1:]))
            if v is not None:
                return c_toks[v], c_lps[v]
            return toks[t.depths[node]], lps[t.depths[node]]  # a path pass 1 never saw: fall back to marginals

        return best_first(anchor, child_fn, budget, self.width, self.depth, eager=False)

    def _dense(self, q_draft: torch.Tensor) -> torch.Tensor:
        q = torch.zeros(self.vocab_size, dtype=torch.float32)
        q[self.vocab_ids.cpu()] = q_draft.float().cpu()
        return q


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


DRAFTERS = ("jetflow", "jetflow-branch", "ddtree", "dflash", "ngram", "ar")


def make_drafter(name: str, head: JetFlowHead | None = None, bidir_head: JetFlowHead | None = None, width: int = 8):
    """jetflow: causal head + the paper's tree; jetflow-branch: causal head, branch-conditioned; ddtree: bidirectional
    head + best-first tree; dflash: bidirectional head, linear chain; ngram: prompt lookup; ar: no drafting."""
    if name == "ar":
        return ARDrafter()
    if name == "ngram":
        return NgramDrafter()
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")
    h = head if name.startswith("jetflow") else (bidir_head or head)
    if h is None:
        raise ValueError(f"drafter {name!r} needs a draft head")
    mode = {"jetflow": "tree", "jetflow-branch": "branch", "ddtree": "tree", "dflash": "chain"}[name]
    return HeadDrafter(h, mode=mode, width=width, eager=name != "jetflow-branch", name=name)
