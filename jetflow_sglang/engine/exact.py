"""Exact rows: every row of a verify forward rounds exactly as a one-token decoding step does (CPU targets).

Greedy speculative decoding is lossless in exact arithmetic, but in bfloat16 a tree's rows and a one-token step round
differently, so at a near-tie the two pick different tokens and the texts part (float32 hides this in practice). Which
text comes out can then depend on the budget, and with `auto` on the machine's load. Measured on SmolLM2-135M, bf16,
a 2-core EPYC with AVX512-BF16 (2026-12-03), three sources:
- oneDNN's bf16 GEMM takes one kernel for 1-3 rows and another from 4 rows; they round differently (the
  1536 -> 576 MLP down-projection differed in the last bit for the same row). On an AMX Xeon (2026-12-06) it takes a
  third above 32 rows for some shapes (the 576 -> 1536 up-projection, the LM head);
- torch's CPU SDPA rounds a row differently with the number of query rows and keys around it (a 4-node tree's root
  logits were off the one-token step's by up to 0.4);
- a float32 attention sums a node's terms in another order when its ancestors are scattered among other nodes'
  columns than when they sit in a row, as in plain decoding.
With exact rows on, the target's linears pad inputs of fewer than MIN_ROWS rows with zero rows and multiply more than
rowgemm.EXACT_MAX_ROWS in chunks of that many (the same kernel for every row count), one-token steps go through the
tree attention too, and the tree attention works in float64 (`jetflow_sglang.kernels.hf_tree_attention.
cpu_tree_attention`). Greedy output is then token-identical to plain decoding (with the same setting) in bf16 too, whatever budget or tree: 60 of 60 generations on that machine (12 prompts x budgets 3, 16,
64, 256, auto; tests/test_exact.py). The price: a verify forward costs 1.0-1.35x SDPA's at 8-16 nodes (more with long
contexts and large trees: bench/results/cpu_attention.md) and the one-token step about 1.25x (52 -> 64 ms there), so
it is opt-in (`jetflow generate --exact on`, `load_stack(exact="on")`). `check` tests on the loaded model whether
this machine's kernels keep the promise.
"""
from __future__ import annotations

import random

import torch

from jetflow_sglang.kernels.hf_tree_attention import MIN_ROWS, NAME

from jetflow_sglang.core.tree import DraftTree

_ATTR = "_jetflow_min_rows"  # read by rowgemm's nn.Linear forward


def applies(target) -> bool:
    """Exact rows need a CPU target that verifies through the jetflow_tree attention (GPUs verify in Triton)."""
    return target.device.type == "cpu" and target.model.config._attn_implementation == NAME


def enable(target, on: bool = True) -> None:
    """Turn exact rows on (or off) for this target: its linears' minimum rows and its one-token steps."""
    for mod in target.model.modules():
        if isinstance(mod, torch.nn.Linear):
            setattr(mod, _ATTR, MIN_ROWS if on else 1)
    target.exact = bool(on)


@torch.no_grad()
def check(target, steps: int = 24, seed: int = 0) -> dict:
    """Do verify rows reproduce one-token steps bit for bit on this machine, with exact rows as they are set now?

    Prefills a fixed 64-token prompt, takes `steps` greedy one-token steps, then verifies (a) that chain alone and
    scattered among 3, 40 and 200 random nodes (so a node's ancestors are not next to each other, as in a real
    tree), comparing every chain node's logits with its step's, and (b) random trees of 2-65 nodes, comparing the
    root row with the first step. Returns {"ok", "cases", "mismatches",
    "max_abs_diff"}. Leaves the target's KV cache in a scratch state: prefill again."""
    vocab = int(target.config.vocab_size)
    rng = random.Random(seed)
    prompt = [(7 * i + 3) % vocab for i in range(64)]
    _, _ = target.prefill(prompt)
    base = target.length
    tokens, ref = [prompt[-1]], []
    for _ in range(steps):
        logits, _ = target.verify(DraftTree.root(tokens[-1]))
        target.commit([0])
        ref.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    trees = []  # (tree, node ids of the steps' tokens in it)
    for extra in (0, 3, 40, 200):  # the chain's nodes scattered among random ones, as in a real tree
        tree, chain = DraftTree.root(tokens[0]), [0]
        for i in range(1, steps):
            for _ in range(rng.randint(0, 2 * extra // steps)):
                tree.add(rng.randrange(vocab), rng.randrange(len(tree)), 0.0)
            chain.append(tree.add(tokens[i], chain[-1], 0.0))
        while len(tree) < steps + extra:
            tree.add(rng.randrange(vocab), rng.randrange(len(tree)), 0.0)
        trees.append((tree, chain))
    for n in (2, 3, 5, 9, 17, 33, 65):
        tree = DraftTree.root(tokens[0])
        for i in range(1, n):
            tree.add(rng.randrange(vocab), rng.randrange(i), 0.0)
        trees.append((tree, [0]))
    mismatches, worst = 0, 0.0
    for tree, rows in trees:
        target.cache.crop(base - target.cache.get_seq_length())  # drop the steps (or the last tree) again
        target.length = base
        logits, _ = target.verify(tree)
        for step, node in enumerate(rows):
            if not torch.equal(logits[node], ref[step]):
                mismatches += 1
                worst = max(worst, float((logits[node] - ref[step]).abs().max()))
    return {"ok": mismatches == 0, "cases": sum(len(rows) for _, rows in trees), "mismatches": mismatches,
            "max_abs_diff": worst}


def setup(target, mode: str = "off") -> bool:
    """mode "on": exact rows (an error where they do not apply); "off": the stock kernels. Returns whether on."""
    if mode not in ("on", "off"):
        raise ValueError(f"exact must be on or off; got {mode!r}")
    if mode == "on" and not applies(target):
        raise ValueError(f"exact rows are for CPU targets that verify through {NAME} attention (this one: "
                         f"{target.device.type}, {target.model.config._attn_implementation})")
    enable(target, mode == "on")
    return target.exact


__all__ = ["MIN_ROWS", "applies", "check", "enable", "setup"]
