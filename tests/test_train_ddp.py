"""Data-parallel head training: 2 CPU processes under gloo equal one process with the doubled batch, and
`torchrun scripts/train_head.py` trains, checkpoints from rank 0 only and resumes with another world size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train import _records, tiny_target

ROOT = Path(__file__).resolve().parents[1]
SEQS, BLOCKS, STEPS = 2, 4, 4


def _cfg():
    from jetflow_sglang.train.trainer import TrainConfig

    # float64 and no autocast: DDP and the single process then differ only in summation order (~1e-15)
    return TrainConfig(lr=3e-3, warmup=1, steps=STEPS, seqs=SEQS, blocks=BLOCKS, branch_prob=0.5, eval_every=2,
                       ckpt_every=100, log_every=1, autocast=False, seed=5)


def _setup(tmp: Path):
    """The same tiny target, heads and shards in every process (built once, loaded from disk)."""
    from jetflow_sglang.train.trainer import draft_vocab, make_head

    model = tiny_target().double()
    blob = torch.load(tmp / "items.pt", weights_only=False)
    items, evals = blob["items"], blob["eval"]
    vocab = draft_vocab(items, 96, model.config.vocab_size)
    heads = {"causal": make_head(model, True, vocab, num_layers=2, n_taps=2).double(),
             "bidir": make_head(model, False, vocab, num_layers=2, n_taps=2).double()}
    return model, heads, items, evals


def _snapshot(heads):
    return {n: (torch.cat([p.detach().flatten() for p in h.parameters()]).clone(),
                torch.cat([p.grad.flatten() for p in h.parameters() if p.grad is not None]).clone())
            for n, h in heads.items()}


def _worker(rank, world, tmp):
    import torch.distributed as tdist

    from jetflow_sglang.train import dist
    from jetflow_sglang.train.trainer import train

    torch.set_num_threads(1)
    tmp = Path(tmp)
    tdist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=world)
    try:
        model, heads, items, evals = _setup(tmp)
        snaps = []
        train(heads, model, dist.shard(items, rank, world), evals if rank == 0 else [], _cfg(), tmp / "ddp",
              progress=False, info=dist.DistInfo(rank, world, rank), on_step=lambda s, h: snaps.append(_snapshot(h)))
        torch.save(snaps, tmp / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def _merge(batches):
    """The union of per-rank batches as one batch (rows padded to the longest sequence)."""
    T = max(b["ids"].shape[1] for b in batches)

    def pad(x):
        return torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1]) if x.dim() == 3 else (0, T - x.shape[1]))

    out = {k: torch.cat([pad(b[k]) for b in batches]) for k in ("taps", "final", "ids")}
    out.update({k: torch.cat([b[k] for b in batches]) for k in ("anchors", "lengths", "k")})
    out["block_size"] = batches[0]["block_size"]
    return out


def test_two_gloo_ranks_equal_one_process_with_the_doubled_batch(tmp_path):
    import torch.multiprocessing as mp

    from jetflow_sglang.train import dist
    from jetflow_sglang.train.features import build_cache
    from jetflow_sglang.train.trainer import head_loss, sample_batch, step_rng, train

    model = tiny_target()
    recs = _records(model, n=10, T=40)
    items = build_cache(model, recs, [1, 3], tmp_path / "c", progress=False)
    torch.save({"items": items[:8], "eval": items[8:]}, tmp_path / "items.pt")
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(r0) == len(r1) == STEPS

    # one process, both ranks' batches at once (2 x SEQS sequences), through the same training loop
    model, heads, items, evals = _setup(tmp_path)
    cfg = _cfg()
    shards = [dist.shard(items, r, 2) for r in (0, 1)]
    sampler = lambda step: _merge([sample_batch(shards[r], step_rng(cfg, step, r), SEQS, BLOCKS, 16,  # noqa: E731
                                                cfg.branch_prob) for r in (0, 1)])
    single = []
    init = {n: [p.detach().clone() for p in h.parameters()] for n, h in heads.items()}
    train(heads, model, items, evals, cfg, tmp_path / "one", progress=False, sampler=sampler,
          on_step=lambda s, h: single.append(_snapshot(h)))

    for step in range(STEPS):
        for n in ("causal", "bidir"):
            w0, g0 = r0[step][n]
            w1, g1 = r1[step][n]
            assert torch.equal(w0, w1), f"ranks diverged at step {step + 1} ({n})"  # DDP: bit-identical replicas
            ws, gs = single[step][n]
            torch.testing.assert_close(g0, gs, rtol=1e-9, atol=1e-12)  # averaged gradient == doubled-batch gradient
            torch.testing.assert_close(w0, ws, rtol=1e-9, atol=1e-10)
    assert not torch.equal(r0[0]["causal"][0], r0[-1]["causal"][0])  # it did train

    # only rank 0 wrote the checkpoint and the log; the loss on a fixed batch fell
    log = [json.loads(x) for x in open(tmp_path / "ddp" / "log.jsonl")]
    assert {r["world"] for r in log if "loss" in r} == {2} and any("eval_kl" in r for r in log)
    st = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)
    assert st["step"] == STEPS and st["world"] == 2
    lm_w = model.get_output_embeddings().weight[heads["causal"].vocab_ids]
    vmap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vmap[heads["causal"].vocab_ids] = torch.arange(len(heads["causal"].vocab_ids))
    fixed = sample_batch(items, step_rng(cfg, 999, 0), 8, 8, 16, 0.0)
    for n, h in heads.items():
        after = head_loss(h, fixed, lm_w, vmap, cfg, False, "cpu")[0].item()
        with torch.no_grad():
            for p, p0 in zip(h.parameters(), init[n]):
                p.copy_(p0)
        before = head_loss(h, fixed, lm_w, vmap, cfg, False, "cpu")[0].item()
        assert after < before, (n, before, after)


def _write_target(path: Path):
    model = tiny_target()
    model.save_pretrained(path)
    return model


@pytest.mark.slow
def test_torchrun_trains_and_resumes_with_another_world_size(tmp_path):
    model = _write_target(tmp_path / "target")
    with open(tmp_path / "data.jsonl", "w") as f:
        for r in _records(model, n=9, T=40):
            f.write(json.dumps(r) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    args = ["scripts/train_head.py", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.jsonl"),
            "--run-dir", str(tmp_path / "run"), "--vocab", "96", "--taps", "2", "--seqs", "2", "--blocks", "4",
            "--minutes", "0", "--eval-every", "3", "--log-every", "1", "--eval-frac", "0.2", "--threads", "1",
            "--out-causal", str(tmp_path / "head"), "--out-bidir", str(tmp_path / "head-bidir")]
    run = lambda pre, steps: subprocess.run(pre + args + ["--steps", str(steps)], cwd=ROOT, env=env,  # noqa: E731
                                            capture_output=True, text=True, timeout=600)
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], 3)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    feats = sorted(x.name for x in (tmp_path / "run" / "features").glob("feat_*.pt"))
    assert any(x.startswith("feat_r0_") for x in feats) and any(x.startswith("feat_r1_") for x in feats)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["command"].startswith("torchrun")
    assert summary["final_eval"]["causal"]["eval_blocks"] > 0
    assert (tmp_path / "head" / "config.json").exists() and (tmp_path / "head-bidir" / "config.json").exists()
    # resume on one process: continues at step 3, the features of both former ranks are found, nothing recomputed
    p = run([sys.executable], 5)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resumed from" in p.stdout and "world size 1 (was 2)" in p.stdout
    assert sorted(x.name for x in (tmp_path / "run" / "features").glob("feat_*.pt")) == feats
    log = [json.loads(x) for x in open(tmp_path / "run" / "log.jsonl") if '"loss"' in x]
    assert [r["world"] for r in log if r["head"] == "causal"] == [2] * 3 + [1] * 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 5
