"""Block-distillation trainer for JetFlow heads (causal and bidirectional from the same code).

One training row = one regenerated sequence: its cached target taps are the context, and `blocks` random anchors in
the continuation region each open a block [anchor, MASK x (B-1)] at positions anchor..anchor+B-1. Slot j predicts the
token at anchor+j; its teacher is the target distribution at anchor+j-1 on the same sequence. A block sees context rows
< anchor and (causally or fully) its own slots, never another block, so many blocks train in one forward.

Branch-conditioned blocks (causal heads only): with probability `branch_prob` slots 1..k hold the real tokens y_1..y_k
(k uniform in 1..B-2) and only slots > k are scored. That is exactly the drafter's conditioned pass, where a MASK query
follows a node's real ancestor tokens (drafters.HeadDrafter.conditioned_logprobs).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from jetflow_sglang.head import MASK, JetFlowHead, JetFlowHeadConfig, init_from_target, save_head
from jetflow_sglang.train import dist
from jetflow_sglang.train import losses as L


@dataclass
class TrainConfig:
    loss: str = "fkl"
    gamma: float = 0.0
    lr: float = 3e-4
    warmup: int = 30
    schedule: str = "cosine"  # after warm-up: "cosine" (to 0 at the end) or "constant"
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    clip: float = 1.0
    seqs: int = 4  # sequences per step
    blocks: int = 16  # anchors per sequence
    branch_prob: float = 0.3
    steps: int = 1000  # upper bound on steps
    minutes: float = 0.0  # >0: the cosine schedule runs on wall time and training stops there
    eval_every: int = 100
    ckpt_every: int = 100
    ckpt_minutes: float = 0.0  # >0: also checkpoint after this much training time (a lease may end any moment)
    log_every: int = 10
    seed: int = 0
    device: str = "cpu"
    autocast: bool = True
    extra: dict = field(default_factory=dict)


def draft_vocab(items: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """EAGLE-3-style reduced vocabulary: the `size` most frequent continuation tokens, topped up with the lowest unused
    ids; returned sorted. A token outside it can never be drafted, so measure its coverage on eval data."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    cnt = Counter()
    for it in items:  # records (list ids) or cached items (tensor ids): every rank counts all records alike
        cont = it["ids"][it["prompt_len"]:]
        cnt.update(cont.tolist() if torch.is_tensor(cont) else cont)
    ids = [t for t, _ in cnt.most_common(size)]
    chosen = set(ids)
    fill = (t for t in range(vocab_size) if t not in chosen)
    ids += [next(fill) for _ in range(size - len(ids))]
    return torch.tensor(sorted(ids))


def make_head(target_model, causal: bool, vocab_ids: torch.Tensor, num_layers: int = 2, n_taps: int = 4,
              block_size: int = 16, mask_token_id: int | None = None) -> JetFlowHead:
    """mask_token_id (release layout, head/export.py): mask slots embed this token with the target's embedding (no
    learned mask vector), q/k norms on, full vocabulary; such a head exports exactly (`jetflow export-head`)."""
    cfg = JetFlowHeadConfig.for_target(target_model.config, num_layers=num_layers, n_taps=n_taps, causal=causal,
                                       draft_vocab_size=len(vocab_ids), block_size=block_size)
    if mask_token_id is not None:
        if not torch.equal(vocab_ids.cpu(), torch.arange(target_model.config.vocab_size)):
            raise ValueError("a release-layout head drafts over the full vocabulary (use --vocab 0)")
        cfg.qk_norm, cfg.draft_vocab_size, cfg.mask_token_id = True, 0, mask_token_id
        cfg.check_target(target_model.config)
    head = JetFlowHead(cfg)
    init_from_target(head, target_model)
    head.vocab_ids.copy_(vocab_ids)
    if mask_token_id is not None:
        head.mask_embedding.requires_grad_(False)  # unused: no gradient, and none for DDP to wait for
    return head.float().bind(target_model)


# ------------------------------------------------------------------------------------------------- batches
def sample_batch(items: list[dict], rng: random.Random, seqs: int, blocks: int, block_size: int,
                 branch_prob: float) -> dict:
    """Pick sequences and anchors; everything a head step needs except the mask flavour."""
    rows = [items[rng.randrange(len(items))] for _ in range(seqs)]
    return build_batch(rows, rng, blocks, block_size, branch_prob)


def build_batch(rows: list[dict], rng: random.Random, blocks: int, block_size: int, branch_prob: float) -> dict:
    """Anchors and branch lengths for the sequences `rows`, padded into one batch. Rows with cached features (`taps`,
    `final`) bring them along in their dtype; rows without (the online teacher, online.py) leave them to be filled."""
    seqs = len(rows)
    T = max(len(r["ids"]) for r in rows)
    feats = "taps" in rows[0]
    if feats:
        nt, dev, dt = rows[0]["taps"].shape[1], rows[0]["taps"].device, rows[0]["taps"].dtype  # maybe on the GPU
        taps = torch.zeros(seqs, T, nt, dtype=dt, device=dev)
        final = torch.zeros(seqs, T, rows[0]["final"].shape[1], dtype=dt, device=dev)
    ids = torch.zeros(seqs, T, dtype=torch.long)
    anchors = torch.zeros(seqs, blocks, dtype=torch.long)
    lengths = torch.zeros(seqs, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], lengths[i] = torch.as_tensor(r["ids"]), n
        if feats:
            taps[i, :n], final[i, :n] = r["taps"], r["final"]
        lo, hi = r["prompt_len"], n - 2  # anchor = a committed continuation token with at least one token after it
        cand = list(range(lo, hi + 1)) or [max(n - 2, 0)]
        pick = rng.sample(cand, blocks) if len(cand) >= blocks else [rng.choice(cand) for _ in range(blocks)]
        anchors[i] = torch.tensor(pick)
    # branch-conditioned blocks: k real tokens after the anchor (0 = plain MASK block)
    k = torch.tensor([[rng.randint(1, block_size - 2) if rng.random() < branch_prob else 0 for _ in range(blocks)]
                      for _ in range(seqs)])
    k = torch.minimum(k, (lengths[:, None] - 2 - anchors).clamp(min=0))  # real tokens must exist, one slot stays scored
    b = {"ids": ids, "anchors": anchors, "lengths": lengths, "k": k, "block_size": block_size}
    return {"taps": taps, "final": final, **b} if feats else b


def head_inputs(b: dict, causal: bool, branch: bool):
    """tokens/positions [B, S], mask [B, S, T+S], plus the scored-slot index (row, block, depth) and teacher positions."""
    B, nb = b["anchors"].shape
    bs, T = b["block_size"], b["ids"].shape[1]
    j = torch.arange(bs)
    pos = b["anchors"][..., None] + j  # [B, nb, bs]
    real = b["ids"].gather(1, pos.clamp(max=T - 1).flatten(1)).view(B, nb, bs)
    k = b["k"] if branch else torch.zeros_like(b["k"])
    tokens = torch.where((j == 0) | (j <= k[..., None]), real, torch.full_like(real, MASK))
    # context: rows < anchor; block: own slots only (lower-triangular when causal)
    ctx = torch.arange(T)[None, None, None, :] < b["anchors"][..., None, None]  # [B, nb, 1, T]
    ctx = ctx.expand(B, nb, bs, T)
    inner = torch.ones(bs, bs, dtype=torch.bool)
    if causal:
        inner = inner.tril()
    eye = torch.eye(nb, dtype=torch.bool)
    blk = (eye[:, None, :, None] & inner[None, :, None, :]).reshape(nb * bs, nb * bs)  # block-diagonal
    mask = torch.cat([ctx.reshape(B, nb * bs, T), blk.expand(B, -1, -1)], -1)
    # scored slots: depth >= 1, inside the sequence, after the real-token prefix
    scored = (j >= 1) & (pos < b["lengths"][:, None, None]) & (j > k[..., None])
    return tokens.flatten(1), pos.flatten(1), mask, scored


def head_loss(head: JetFlowHead, b: dict, lm_w: torch.Tensor, vocab_map: torch.Tensor, cfg: TrainConfig,
              branch: bool, device) -> tuple[torch.Tensor, dict]:
    """Distillation loss of one head on batch `b` and per-depth metrics (teacher-argmax agreement, top-8 hit)."""
    tokens, pos, mask, scored = head_inputs(b, head.config.causal, branch)
    B, nb = b["anchors"].shape
    bs, T = b["block_size"], b["ids"].shape[1]
    ctx_pos = torch.arange(T, device=device)[None].expand(B, T)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.autocast):
        kv = head.context_kv(b["taps"].to(device), ctx_pos)
        hidden = head(tokens.to(device), pos.to(device), kv, mask.to(device)).view(B, nb, bs, -1)
    r, blk, d = scored.nonzero(as_tuple=True)
    h = hidden[r.to(device), blk.to(device), d.to(device)]
    tpos = (b["anchors"][r, blk] + d - 1)
    with torch.no_grad():
        t_logp = (b["final"][r, tpos].to(device).to(lm_w.dtype) @ lm_w.T).float().log_softmax(-1)
        labels = vocab_map.to(device)[b["ids"][r, tpos + 1].to(device)]
    s_logits = (h.to(lm_w.dtype) @ lm_w.T).float()
    per = L.slot_loss(cfg.loss, s_logits, t_logp, labels.clamp(min=0))
    w = L.depth_weights(d.to(device), cfg.gamma)
    if cfg.loss == "sft":
        w = w * (labels >= 0)  # a label outside the draft vocab cannot be learned
    # normalised by the weight of ALL ranks' slots, times the world size: DDP's gradient average then equals the
    # gradient of one process on the union of the ranks' batches (a plain per-rank mean would weight ranks equally)
    total_w = dist.all_reduce(w.sum().detach().clone(), "sum").clamp(min=1e-8)
    world = torch.distributed.get_world_size() if dist.active() else 1
    loss = (per * w).sum() / total_w * world
    with torch.no_grad():
        agree = (s_logits.argmax(-1) == t_logp.argmax(-1)).float()
        kl = L.forward_kl(s_logits, t_logp)
        m = {"loss": L.weighted_mean(per, w).item(), "kl": kl.mean().item(), "n": int(len(d))}
        for depth in (1, 2, 4, 8, 15):
            sel = d.to(device) == depth
            if sel.any():
                m[f"acc{depth}"] = agree[sel].mean().item()
    return loss, m


@torch.no_grad()
def evaluate(head: JetFlowHead, items: list[dict], lm_w, vocab_map, cfg: TrainConfig, device, blocks: int = 16,
             width: int = 8, teacher=None) -> dict:
    """Held-out: KL, depth-1 agreement and an acceptance proxy for MASK blocks.

    tau_w8: 1 + the leading depths whose target-greedy token is in the head's top-8 (the per-depth top-8 tree with no
    budget limit, as the paper's tree builds it); tau_chain: the same for the head's argmax (a DFlash chain).
    `teacher(batch) -> batch` fills the features of items that carry none (the online teacher).
    """
    head.eval()
    rng = random.Random(1234)
    kls, acc1, tw, tc = [], [], [], []
    bs = head.config.block_size
    for i in range(0, len(items), cfg.seqs):
        b = sample_batch(items[i:i + cfg.seqs], rng, min(cfg.seqs, len(items) - i), blocks, bs, 0.0)
        if teacher is not None:
            b = teacher(b)
        tokens, pos, mask, scored = head_inputs(b, head.config.causal, False)
        B, nb = b["anchors"].shape
        T = b["ids"].shape[1]
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.autocast):
            kv = head.context_kv(b["taps"].to(device), torch.arange(T, device=device)[None].expand(B, T))
            hid = head(tokens.to(device), pos.to(device), kv, mask.to(device)).view(B, nb, bs, -1)
        full = scored[..., 1:].all(-1)  # blocks whose 15 slots all lie inside the sequence
        for r, blk in full.nonzero().tolist():
            a = int(b["anchors"][r, blk])
            s = (hid[r, blk, 1:].to(lm_w.dtype) @ lm_w.T).float()
            t = (b["final"][r, a:a + bs - 1].to(device).to(lm_w.dtype) @ lm_w.T).float().log_softmax(-1)
            g = t.argmax(-1)  # the target's greedy token at each depth, along the real sequence
            on_path = (vocab_map.to(device)[b["ids"][r, a + 1:a + bs].to(device)] == g).long()
            kls.append(L.forward_kl(s, t).mean().item())
            acc1.append(float(s[0].argmax() == g[0]))
            top = s.topk(width, -1).indices
            hit_w = (top == g[:, None]).any(-1).long() * on_path
            hit_c = (s.argmax(-1) == g).long() * on_path
            tw.append(1 + int(hit_w.cumprod(0).sum()))
            tc.append(1 + int(hit_c.cumprod(0).sum()))
    head.train()
    mean = lambda x: sum(x) / max(len(x), 1)  # noqa: E731
    return {"eval_kl": mean(kls), "eval_acc1": mean(acc1), "tau_w8": mean(tw), "tau_chain": mean(tc),
            "eval_blocks": len(kls)}


# ------------------------------------------------------------------------------------------------- training
def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class _LossStep(torch.nn.Module):
    """A head plus its loss as one module, so DistributedDataParallel sees one forward per step and averages the
    gradients of every head parameter in backward."""

    def __init__(self, head: JetFlowHead):
        super().__init__()
        self.head = head

    def forward(self, b: dict, lm_w, vocab_map, cfg: TrainConfig, branch: bool, device):
        return head_loss(self.head, b, lm_w, vocab_map, cfg, branch, device)


def step_rng(cfg: TrainConfig, step: int, rank: int) -> random.Random:
    """The batch of `rank` at `step` depends on nothing else, so a resumed run (any world size) needs no rng state."""
    return random.Random(f"{cfg.seed}/{step}/{rank}")


def train(heads: dict[str, JetFlowHead], target_model, items: list[dict], eval_items: list[dict], cfg: TrainConfig,
          out_dir, progress: bool = True, info: dist.DistInfo | None = None, on_step=None,
          sampler=None, on_ckpt=None, teacher=None, data_state=None) -> dict[str, list[dict]]:
    """Train all `heads` on identical batches, alternating per step; resumes from out_dir/ckpt.pt.

    Data-parallel when a process group is up (`info.world` > 1): `items` is this rank's shard, each rank draws
    `cfg.seqs` sequences per step from it, DDP averages the gradients, and only rank 0 evaluates (on `eval_items`),
    logs and writes checkpoints. Checkpoints are written every `ckpt_every` steps and every `ckpt_minutes` of
    training. `on_step(step, heads)` runs after every optimiser step (tests use it); `sampler(step) -> batch`
    replaces the default draw of `cfg.seqs` sequences from `items` with step_rng(cfg, step, rank);
    `on_ckpt(step, heads)` runs on rank 0 after every checkpoint (e.g. to export the heads as they are).
    Online teacher (online.py): `teacher(batch) -> batch` fills the features of evaluation batches, and `data_state`
    (state_dict / load_state_dict: the position in a streamed training file) is saved in and restored from the
    checkpoint; `items` may then be empty, the sampler supplies the batches.
    Returns the evaluation history per head (rank 0's; the other ranks return the resumed history).
    """
    from tqdm import tqdm

    info = info or dist.DistInfo()
    main = info.main
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(cfg.device)
    target_model.to(dev)
    vocab_ids = next(iter(heads.values())).vocab_ids
    for h in heads.values():
        if not torch.equal(h.vocab_ids, vocab_ids):
            raise ValueError("heads trained together must share one draft vocabulary")
        h.to(dev).train()
    if not items and sampler is None:
        raise ValueError(f"rank {info.rank} has no training sequences (fewer sequences than ranks?)")
    lm_w = target_model.get_output_embeddings().weight.detach()[vocab_ids.to(dev)].contiguous()
    vocab_map = torch.full((target_model.config.vocab_size,), -1, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(len(vocab_ids))
    opts = {n: torch.optim.AdamW([p for p in h.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas,
                                 weight_decay=cfg.weight_decay) for n, h in heads.items()}
    step, elapsed, history = 0, 0.0, {n: [] for n in heads}
    ck = out / "ckpt.pt"
    if ck.exists():
        st = torch.load(ck, weights_only=False, map_location=dev)
        for n, h in heads.items():
            h.load_state_dict(st["heads"][n])
            opts[n].load_state_dict(st["opts"][n])
        step, elapsed, history = st["step"], st["elapsed"], st["history"]
        if data_state is not None:
            if "data" not in st:
                raise ValueError(f"{ck} holds no data position (an offline run?); use a new run folder")
            data_state.load_state_dict(st["data"])
        if main:
            print(f"[train] resumed from {ck} at step {step} ({elapsed / 60:.1f} min), world size {info.world} "
                  f"(was {st.get('world', 1)})", flush=True)
    steppers = {n: _LossStep(h) for n, h in heads.items()}
    if dist.active():
        from torch.nn.parallel import DistributedDataParallel as DDP

        # device_ids=None: DDP leaves the batch where it is (with device_ids it would move the index tensors that
        # head_inputs combines with host tensors); the module already sits on this rank's device
        steppers = {n: DDP(m, device_ids=None, broadcast_buffers=False) for n, m in steppers.items()}
    last_save = elapsed

    def save_ckpt():
        nonlocal last_save
        last_save = elapsed
        if not main:
            return
        tmp = out / "ckpt.pt.tmp"
        torch.save({"step": step, "elapsed": elapsed, "history": history, "world": info.world,
                    "heads": {n: h.state_dict() for n, h in heads.items()},
                    "opts": {n: o.state_dict() for n, o in opts.items()}, "cfg": asdict(cfg),
                    **({"data": data_state.state_dict()} if data_state is not None else {})}, tmp)
        tmp.replace(ck)
        if on_ckpt is not None:
            on_ckpt(step, heads)

    def prog():
        return elapsed / (cfg.minutes * 60) if cfg.minutes > 0 else step / max(cfg.steps, 1)

    def run_eval():
        if main and eval_items:
            for n, h in heads.items():
                ev = evaluate(h, eval_items, lm_w, vocab_map, cfg, dev, teacher=teacher)
                e = {"step": step, "min": round(elapsed / 60, 2), **ev}
                history[n].append(e)
                log.write(json.dumps({"head": n, **e}) + "\n")
            log.flush()
        dist.barrier()  # the other ranks wait here, so rank 0's evaluation never counts as their training time

    # a time budget has no step count: the bar then shows minutes of training done
    bar = tqdm(total=cfg.minutes if cfg.minutes > 0 else cfg.steps, initial=elapsed / 60 if cfg.minutes > 0 else step,
               desc="train", unit="min" if cfg.minutes > 0 else "step", disable=not (progress and main),
               bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} {unit} [{elapsed}<{remaining}{postfix}]"
               if cfg.minutes > 0 else None)
    log = open(out / "log.jsonl", "a") if main else None
    acc: dict[str, list[dict]] = {n: [] for n in heads}
    block_size = next(iter(heads.values())).config.block_size
    while step < cfg.steps and prog() < 1.0:
        t0 = time.time()
        b = sampler(step) if sampler else sample_batch(items, step_rng(cfg, step, info.rank), cfg.seqs, cfg.blocks,
                                                         block_size, cfg.branch_prob)
        lr = lr_at(cfg, step, prog())
        for n, h in heads.items():
            for g in opts[n].param_groups:
                g["lr"] = lr
            loss, m = steppers[n](b, lm_w, vocab_map, cfg, h.config.causal and cfg.branch_prob > 0, dev)
            opts[n].zero_grad(set_to_none=True)
            loss.backward()
            m["gnorm"] = float(torch.nn.utils.clip_grad_norm_(h.parameters(), cfg.clip))
            opts[n].step()
            acc[n].append(m)
        step += 1
        # every rank uses the slowest rank's clock, so all stop (and change lr) at the same step
        dt = float(dist.all_reduce(torch.tensor([time.time() - t0], dtype=torch.float64), "max")[0])
        elapsed += dt
        if on_step is not None:
            on_step(step, heads)
        bar.update(dt / 60 if cfg.minutes > 0 else 1)
        if main and step % cfg.log_every == 0:
            for n in heads:
                rec = {"step": step, "head": n, "lr": lr, "min": round(elapsed / 60, 2), "world": info.world}
                for key in acc[n][0]:
                    vals = [m[key] for m in acc[n] if key in m]
                    rec[key] = round(sum(vals) / len(vals), 4)
                log.write(json.dumps(rec) + "\n")
                acc[n] = []
            log.flush()
            bar.set_postfix({"step": step, "kl": rec["kl"]} |
                            {f"tau_w8 {n}": f"{history[n][-1]['tau_w8']:.2f}" for n in heads if history[n]})
        if step % cfg.eval_every == 0:
            run_eval()
        if step % cfg.ckpt_every == 0 or (cfg.ckpt_minutes > 0 and elapsed - last_save >= cfg.ckpt_minutes * 60):
            save_ckpt()
            dist.barrier()
    bar.close()
    done = history[next(iter(heads))]
    need = float(main and bool(eval_items) and (not done or done[-1]["step"] != step))
    if dist.all_reduce(torch.tensor([need]), "max")[0] > 0:  # rank 0 decides; every rank joins the barrier
        run_eval()
    save_ckpt()
    if log:
        log.close()
    dist.barrier()
    return history


def export(head: JetFlowHead, out_dir, provenance: dict) -> Path:
    """Save a trained head (bf16 weights, no embedding / LM head) with its training provenance in config.extra."""
    head.config.extra = {**head.config.extra, **provenance}
    return save_head(head, out_dir)
