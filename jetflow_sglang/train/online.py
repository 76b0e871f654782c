"""Online teacher (`scripts/train_head.py --teacher online`): the frozen target runs inside every training step.

The offline path (features.py) caches (taps + 1) x d x 2 bytes per token before training: 48 KB per token for an 8B
target, 4.8 TB for 100M tokens. Here nothing is cached. Each step streams its sequences (stream.py), draws the anchors
exactly as the offline path does (trainer.build_batch), and one no-grad target forward in the target's own dtype
gives the taps and the final-norm rows (the teacher distributions over the draft vocabulary) for the positions those
blocks use: each sequence is cut after its last block's last teacher row. The loss is trainer.head_loss, unchanged.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from jetflow_sglang.train.features import target_features
from jetflow_sglang.train.stream import RecordStream, iter_records
from jetflow_sglang.train.trainer import TrainConfig, build_batch, draft_vocab, step_rng


def as_row(rec: dict) -> dict:
    """A record as the batch builder takes it when the features come later: ids, prompt length, key."""
    return {"key": rec["key"], "prompt_len": rec["prompt_len"], "ids": torch.tensor(rec["ids"], dtype=torch.long)}


class OnlineTeacher:
    """batch -> batch with `taps` [B, T, n*H] and `final` [B, T, H] from the target, on its device and in its dtype.

    Rows past a sequence's last needed position (its deepest anchor + block_size - 2: the teacher row of the last slot)
    are zeros and never computed: the head sees only context rows before an anchor, and the loss reads final rows
    anchor .. anchor + block_size - 2.
    """

    def __init__(self, model, tap_layers: list[int]):
        self.model, self.tap_layers = model, list(tap_layers)
        self.tokens = 0  # sequence tokens through the target so far (throughput accounting)

    @torch.no_grad()
    def __call__(self, b: dict) -> dict:
        need = torch.minimum(b["lengths"], b["anchors"].max(1).values + b["block_size"] - 1)
        T, full = int(need.max()), b["ids"].shape[1]
        att = torch.arange(T)[None] < need[:, None]
        taps, final = target_features(self.model, b["ids"][:, :T], att.long(), self.tap_layers)
        keep = att.to(taps.device)[..., None]
        pad = lambda x: torch.nn.functional.pad(torch.where(keep, x, 0), (0, 0, 0, full - T))  # noqa: E731
        self.tokens += int(need.sum())
        return {**b, "taps": pad(taps), "final": pad(final)}


class OnlineSampler:
    """`sampler(step)` for trainer.train: this rank's share of the next world x seqs streamed records (stream.py),
    anchors from step_rng(cfg, step, rank) as in the offline path, features from the teacher. Its state_dict is the
    stream position, which train() keeps in the checkpoint (pass it as `data_state`)."""

    def __init__(self, stream: RecordStream, teacher: Callable[[dict], dict], cfg: TrainConfig, block_size: int,
                 rank: int = 0, world: int = 1):
        self.stream, self.teacher, self.cfg, self.block_size = stream, teacher, cfg, block_size
        self.rank, self.world = rank, world
        self.last_keys: list[str] = []  # the records of the latest step (tests and logs)

    def rows(self) -> list[dict]:
        rows = [as_row(r) for r in self.stream.take_shard(self.cfg.seqs, self.rank, self.world)]
        self.last_keys = [r["key"] for r in rows]
        return rows

    def __call__(self, step: int) -> dict:
        b = build_batch(self.rows(), step_rng(self.cfg, step, self.rank), self.cfg.blocks, self.block_size,
                        self.cfg.branch_prob)
        return self.teacher(b)

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, st: dict) -> None:
        self.stream.load_state_dict(st)


@dataclass
class Scan:
    """What one streaming pass over the data gives the online run (the offline path reads it from all records)."""
    vocab: torch.Tensor
    n_train: int = 0
    n_cont: int = 0  # continuation tokens of the training records
    n_eval: int = 0
    eval_rows: list[dict] = field(default_factory=list)  # the first `max_eval` held-out records
    coverage: float = 0.0  # of the held-out continuation tokens by the draft vocabulary


def scan(paths, held: Callable[[dict], bool], vocab_size: int, draft_size: int, max_eval: int,
         progress: bool = True) -> Scan:
    """One pass over the files, a record at a time: the draft vocabulary (trainer.draft_vocab over the training
    records, so the same as the offline path's), counts, held-out coverage and the first `max_eval` held-out records."""
    from tqdm import tqdm

    st, ev = Scan(vocab=torch.arange(0)), Counter()

    def training():
        for r in tqdm(iter_records(paths), desc="scan data", unit="rec", disable=not progress):
            cont = r["ids"][r["prompt_len"]:]
            if held(r):
                st.n_eval += 1
                ev.update(cont)
                if len(st.eval_rows) < max_eval:
                    st.eval_rows.append(as_row(r))
                continue
            st.n_train += 1
            st.n_cont += len(cont)
            yield r

    recs = training()
    st.vocab = draft_vocab(recs, draft_size, vocab_size)
    for _ in recs:  # the full vocabulary needs no counts: finish the pass for the rest
        pass
    vset = set(st.vocab.tolist())
    st.coverage = sum(c for t, c in ev.items() if t in vset) / max(sum(ev.values()), 1)
    return st
