"""Online teacher (`--teacher online`): the target inside the training step equals the feature cache, the training
file streams as it is consumed, its position survives a checkpoint, and torchrun trains and resumes on another world
size."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train import _records, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def _fake_records(n, held_every=0):
    """Records with distinct keys and lengths (no target needed); every held_every-th one is held out (mode)."""
    return [{"key": f"s/{i}", "source": "s", "mode": "sample" if held_every and i % held_every == 0 else "greedy",
             "prompt_len": 3, "ids": list(range(5 + i % 7))} for i in range(n)]


def _grads(head):
    return torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])


def _weights(head):
    return torch.cat([p.detach().flatten() for p in head.parameters()])


def test_online_step_equals_offline_step(tmp_path):
    """One training step of both heads through train(): the cached features (offline, stored in float64 here) and the
    target inside the step (online, streamed) give the same batch, loss and gradients within 1e-9 (float64 Qwen3)."""
    from jetflow_sglang.train.features import build_cache
    from jetflow_sglang.train.online import OnlineSampler, OnlineTeacher
    from jetflow_sglang.train.stream import RecordStream
    from jetflow_sglang.train.trainer import (TrainConfig, build_batch, draft_vocab, head_loss, make_head, step_rng,
                                              train)

    model = tiny_target("qwen3").double()
    recs = _records(model, n=6, T=90)
    for i, r in enumerate(recs):  # unequal lengths: padding, and blocks near the end of a sequence
        r["ids"] = r["ids"][:98 - 5 * i]
    _write(tmp_path / "d.jsonl", recs)
    taps = [1, 3]
    cfg = TrainConfig(lr=1e-3, warmup=1, steps=1, seqs=3, blocks=3, branch_prob=0.5, eval_every=100, log_every=1,
                      autocast=False, seed=7)
    vocab = draft_vocab(recs, 96, model.config.vocab_size)
    lm_w = model.get_output_embeddings().weight[vocab]
    vmap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vmap[vocab] = torch.arange(len(vocab))

    def heads():
        torch.manual_seed(0)
        return {"causal": make_head(model, True, vocab, num_layers=2, n_taps=2).double(),
                "bidir": make_head(model, False, vocab, num_layers=2, n_taps=2).double()}

    def run(sampler, name, **kw):
        hs, got, seen = heads(), {}, {}
        wrapped = lambda step: seen.setdefault("b", sampler(step))  # noqa: E731
        train(hs, model, [], [], cfg, tmp_path / name, progress=False, sampler=wrapped,
              on_step=lambda s, h: got.update({n: (_grads(x), _weights(x)) for n, x in h.items()}), **kw)
        loss = {n: head_loss(h, seen["b"], lm_w, vmap, cfg, n == "causal", "cpu")[0] for n, h in heads().items()}
        return got, loss, seen["b"]

    stream = lambda: RecordStream([tmp_path / "d.jsonl"], window=4, seed=cfg.seed)  # noqa: E731
    teacher = OnlineTeacher(model, taps)
    online = OnlineSampler(stream(), teacher, cfg, 16)
    g_on, l_on, b_on = run(online, "on", data_state=online)  # the loss: initial heads on the step's batch

    # offline: the cache of the same records, the rows the stream handed out, the same anchor draw
    keys = [json.loads(x)["key"] for x in stream().take(cfg.seqs)]
    assert keys == online.last_keys and len(set(keys)) == cfg.seqs
    items = {it["key"]: it for it in build_cache(model, recs, taps, None, progress=False, dtype=torch.float64)}
    offline = lambda step: build_batch([items[k] for k in keys], step_rng(cfg, step, 0), cfg.blocks, 16,  # noqa: E731
                                       cfg.branch_prob)
    g_off, l_off, b_off = run(offline, "off")

    for k in ("ids", "anchors", "lengths", "k"):
        assert torch.equal(b_on[k], b_off[k]), k
    assert b_on["taps"].dtype == torch.float64 and (b_on["k"] > 0).any()
    # the teacher ran only as far as the blocks need: rows past each sequence's deepest block are zeros
    need = torch.minimum(b_on["lengths"], b_on["anchors"].max(1).values + 15)
    assert (need < b_on["lengths"]).any() and teacher.tokens == int(need.sum())
    for i, n in enumerate(need.tolist()):
        assert not b_on["final"][i, n:].any()
        torch.testing.assert_close(b_on["taps"][i, :n], b_off["taps"][i, :n], rtol=1e-9, atol=1e-12)
    for n in ("causal", "bidir"):
        torch.testing.assert_close(l_on[n], l_off[n], rtol=1e-9, atol=0)
        torch.testing.assert_close(g_on[n][0], g_off[n][0], rtol=1e-9, atol=1e-12)  # gradients
        torch.testing.assert_close(g_on[n][1], g_off[n][1], rtol=1e-9, atol=1e-12)  # weights after the step
        assert g_on[n][0].abs().max() > 0
    st = torch.load(tmp_path / "on" / "ckpt.pt", weights_only=False)
    assert st["data"]["consumed"] == cfg.seqs


def test_stream_order_shards_and_lazy_reading(tmp_path):
    """The global order shuffles within windows, skips held-out records and repeats per epoch with a new shuffle;
    rank r of N reads every N-th record of each step's slice; a file is read only as far as it is consumed."""
    from jetflow_sglang.train.stream import RecordStream

    recs = _fake_records(40, held_every=5)
    _write(tmp_path / "a.jsonl", recs[:25])
    _write(tmp_path / "b.jsonl", recs[25:])
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"key": "torn", "ids": [1, 2')  # a killed regeneration run's last line
    keep = lambda r: r["mode"] == "greedy"  # noqa: E731
    train_keys = [r["key"] for r in recs if keep(r)]
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]

    s = RecordStream(files, keep, window=6, seed=3)
    first = [json.loads(x)["key"] for x in s.take(3)]
    size = sum(p.stat().st_size for p in files)
    assert s.bytes_read < size / 3  # one window (+ the held-out lines inside it), not the files
    order = first + [json.loads(x)["key"] for x in s.take(2 * len(train_keys) - 3)]
    epoch0, epoch1 = order[:len(train_keys)], order[len(train_keys):]
    assert sorted(epoch0) == sorted(train_keys) == sorted(epoch1) and epoch0 != epoch1
    assert epoch0 != train_keys  # shuffled ...
    for w in range(0, len(train_keys), 6):  # ... within windows of 6 training records
        assert sorted(epoch0[w:w + 6]) == sorted(train_keys[w:w + 6])

    # shards: each rank's records of a step are every world-th of the global slice, and the ranks stay in lockstep
    ranks = [RecordStream(files, keep, window=6, seed=3) for _ in range(3)]
    for step in range(5):
        got = [[r["key"] for r in st.take_shard(2, rank, 3)] for rank, st in enumerate(ranks)]
        glob = order[step * 6:(step + 1) * 6]
        assert got == [glob[0::3], glob[1::3], glob[2::3]]
    assert {json.dumps(st.state_dict()) for st in ranks} == {json.dumps(ranks[0].state_dict())}

    # resume from a saved position at another world size: the global sequence continues where it stopped
    mid = RecordStream(files, keep, window=6, seed=3)
    mid.take(11)
    again = RecordStream(files, keep, window=6, seed=3)
    again.load_state_dict(json.loads(json.dumps(mid.state_dict())))
    assert [r["key"] for r in again.take_shard(3, 0, 2)] == order[11:17][0::2]
    with pytest.raises(ValueError, match="window"):
        RecordStream(files, keep, window=5, seed=3).load_state_dict(mid.state_dict())
    with pytest.raises(ValueError, match="no training records"):
        RecordStream(files, lambda r: False, window=6).take(1)


def test_resumed_online_run_reads_what_the_uninterrupted_run_reads_next(tmp_path):
    """4 steps straight vs 2 steps, a checkpoint, and 2 more in a fresh process state: the same records per step and
    the same final weights (the stream position lives in the checkpoint)."""
    from jetflow_sglang.train.online import OnlineSampler, OnlineTeacher
    from jetflow_sglang.train.stream import RecordStream
    from jetflow_sglang.train.trainer import TrainConfig, draft_vocab, make_head, train

    model = tiny_target()
    recs = _records(model, n=7, T=30)
    _write(tmp_path / "d.jsonl", recs)
    vocab = draft_vocab(recs, 96, model.config.vocab_size)

    def go(name, steps):
        torch.manual_seed(0)
        heads = {"causal": make_head(model, True, vocab, num_layers=1, n_taps=2)}
        cfg = TrainConfig(lr=1e-3, warmup=1, schedule="constant", steps=steps, seqs=2, blocks=3, eval_every=100,
                          ckpt_every=2, log_every=1, seed=1)
        sampler = OnlineSampler(RecordStream([tmp_path / "d.jsonl"], window=3, seed=1), OnlineTeacher(model, [1, 3]),
                                cfg, 16)
        keys = []
        train(heads, model, [], [], cfg, tmp_path / name, progress=False, sampler=sampler, data_state=sampler,
              on_step=lambda s, h: keys.append(sampler.last_keys))
        return keys, _weights(heads["causal"])

    straight, w_straight = go("a", 4)
    assert len({k for ks in straight for k in ks}) == 7  # 8 reads of 7 records: one full epoch and a bit
    part1, _ = go("b", 2)
    part2, w_resumed = go("b", 4)
    assert part1 + part2 == straight
    torch.testing.assert_close(w_resumed, w_straight, rtol=0, atol=0)
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["data"]["consumed"] == 8


@pytest.mark.slow
def test_torchrun_online_trains_and_resumes_with_another_world_size(tmp_path):
    model = tiny_target("qwen3")
    model.save_pretrained(tmp_path / "target")
    recs = _records(model, n=9, T=40)
    _write(tmp_path / "data.jsonl", recs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    args = ["scripts/train_head.py", "--teacher", "online", "--target", str(tmp_path / "target"),
            "--data", str(tmp_path / "data.jsonl"), "--run-dir", str(tmp_path / "run"), "--vocab", "96",
            "--taps", "2", "--seqs", "2", "--blocks", "4", "--minutes", "0", "--eval-every", "3", "--log-every", "1",
            "--eval-frac", "0.2", "--threads", "1", "--stream-window", "4",
            "--out-causal", str(tmp_path / "head"), "--out-bidir", str(tmp_path / "head-bidir")]
    run = lambda pre, steps: subprocess.run(pre + args + ["--steps", str(steps)], cwd=ROOT, env=env,  # noqa: E731
                                            capture_output=True, text=True, timeout=600)
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], 3)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not (tmp_path / "run" / "features").exists()  # no feature cache
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["teacher"] == "online" and summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["final_eval"]["causal"]["eval_blocks"] > 0  # the target ran for the held-out records too
    assert (tmp_path / "head" / "config.json").exists() and (tmp_path / "head-bidir" / "config.json").exists()
    st = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert st["data"]["consumed"] == 3 * 2 * 2  # steps x ranks x seqs
    p = run([sys.executable], 5)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resumed from" in p.stdout and "world size 1 (was 2)" in p.stdout
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["data"]["consumed"] == 12 + 2 * 2
    log = [json.loads(x) for x in open(tmp_path / "run" / "log.jsonl") if '"loss"' in x]
    assert [r["world"] for r in log if r["head"] == "causal"] == [2] * 3 + [1] * 2
