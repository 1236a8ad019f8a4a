"""The training loop shared by every drafter kind: batches, schedule, checkpoints, held-out tau.

A *task* (``tasks.DFlashTask``, ``tasks.MTPTask``) owns the drafter being trained and knows its
loss; this module owns everything else:

- batches of whole sequences (prompt + the target's reply) under a token budget, in a seeded
  order per epoch, so a resumed run replays exactly the batches it had not yet seen;
- AdamW with linear warm-up and cosine decay, gradient clipping, bf16 autocast on CUDA;
- the frozen target computes the features the drafter needs, batch by batch, on the fly;
- a checkpoint (``OUT.ckpt.pt``: weights, optimiser, step) every few minutes, at each epoch's
  end, on Ctrl-C / SIGTERM and at ``--time-limit``; rerunning the same command resumes it;
- a held-out tau each epoch, by real speculative decoding of prompts never trained on;
- the drafter directory is written to a temporary sibling and renamed when done.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..bench import git_commit, machine_description
from ..errors import ConfigError
from .data import Distilled


@dataclass
class TrainConfig:
    epochs: float = 6.0
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 16384  # padded tokens per batch (sequences x longest)
    max_len: int = 2048  # longer sequences are cut
    # batches are padded to a multiple of this many positions: few distinct shapes, so cuDNN's attention
    # builds few plans (~134 ms each on the H200, forward and backward; the real data's 250 batches had
    # 176 distinct lengths, rounded to 64 they have ~20 shapes: benchmarks/profile_train_step_h200.json)
    pad_multiple: int = 64
    seed: int = 0
    checkpoint_minutes: float = 5.0
    time_limit_minutes: float | None = None
    minutes: float | None = None  # a schedule on the clock: it ends when these minutes of training are spent
    eval_prompts: list = field(default_factory=list)  # token ids of held-out prompts
    eval_tokens: int = 128


class Stopped(Exception):
    """Training stopped early (time limit or a signal) after saving a checkpoint."""


def padded_length(n: int, max_len: int, multiple: int = 1) -> int:
    """``n`` rounded up to a multiple of ``multiple``, at most ``max_len``."""
    return min(-(-n // multiple) * multiple, max_len)


def make_batches(seqs: list[tuple[list[int], int]], batch_tokens: int, max_len: int,
                 multiple: int = 1) -> list[list[int]]:
    """Indices of sequences grouped by length so that ``len(batch) * longest <= batch_tokens``, the
    longest rounded up to a multiple of ``multiple`` (as :func:`collate` pads it)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    batches, cur, longest = [], [], 0
    for i in order:
        n = padded_length(len(seqs[i][0]), max_len, multiple)
        if cur and (len(cur) + 1) * max(longest, n) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def collate(seqs, idx: list[int], max_len: int, device, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[B, L]`` and ``label_valid [B, L]`` (True at reply tokens); ``L`` is the
    longest sequence rounded up to a multiple of ``multiple`` (at most ``max_len``)."""
    width = padded_length(max(len(seqs[i][0]) for i in idx), max_len, multiple)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    for r, i in enumerate(idx):
        toks, first = seqs[i]
        toks = toks[:width]
        ids[r, : len(toks)] = torch.tensor(toks)
        valid[r, first: len(toks)] = True
    return ids.to(device), valid.to(device)


def lr_at(step: int, total: int, cfg: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warm-up over the first ``cfg.warmup`` of the run, cosine decay to zero after it.

    The run's progress is ``step / total``; with ``cfg.minutes`` it is that or the share of those
    minutes spent (``elapsed`` seconds), whichever is further, so the schedule ends with the clock.
    """
    if not cfg.minutes:
        warm = max(1, int(cfg.warmup * total))
        if step < warm:
            return cfg.lr * (step + 1) / warm
        p = (step - warm) / max(1, total - warm)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))
    q = min(1.0, max(step / total, elapsed / (60.0 * cfg.minutes)))
    if q < cfg.warmup:
        return cfg.lr * max(q, 1.0 / total) / cfg.warmup
    p = (q - cfg.warmup) / max(1e-9, 1.0 - cfg.warmup)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * p))


def held_out_tau(task, target, prompts: list[list[int]], n_tokens: int, stop_ids) -> float:
    """Mean accepted tokens per target step (drafts accepted + the target's own), greedy."""
    from ..engine import SpeculativeGenerator
    from ..sampling import SamplingParams

    if not prompts:
        return float("nan")
    drafter, k = task.inference_drafter()
    gen = SpeculativeGenerator(target, drafter, k)
    steps = accepted = 0
    for p in prompts:
        res = gen.generate(p, n_tokens, SamplingParams(), eos_ids=list(stop_ids))
        steps += res.stats.steps
        accepted += sum(res.stats.accepted)
    return (accepted + steps) / max(steps, 1)


def train(task, loaded, data: Distilled, out: str, cfg: TrainConfig, *, restart: bool = False, log=print) -> dict:
    """Train ``task``'s drafter on ``data``; write it to ``out``. Returns a summary dict."""
    target = loaded.model
    dev = target.device
    seqs = data.sequences()
    if not seqs:
        raise ConfigError("no training sequences: every reply is empty")
    batches = make_batches(seqs, cfg.batch_tokens, cfg.max_len, cfg.pad_multiple)
    per_epoch = len(batches)
    total = max(1, int(round(cfg.epochs * per_epoch)))
    params = [p for p in task.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt = out.rstrip("/") + ".ckpt.pt"
    recipe = {"task": task.recipe(), "sequences": len(seqs), "batches": per_epoch, "total": total, "seed": cfg.seed,
              "pad_multiple": cfg.pad_multiple}
    if cfg.minutes:
        recipe["minutes"] = cfg.minutes
    step, spent = 0, 0.0
    if os.path.exists(ckpt) and not restart:
        state = torch.load(ckpt, map_location=dev, weights_only=False)
        if state.get("recipe") != recipe:
            raise ConfigError(f"{ckpt}: a checkpoint of a different run (other data or settings); "
                              "pass --restart to discard it, or rerun the original command")
        task.load_state_dict(state["task"])
        opt.load_state_dict(state["opt"])
        step, spent = state["step"], state.get("seconds", 0.0)
        log(f"resuming from {ckpt} at step {step}/{total}")

    def save_ckpt():
        os.makedirs(os.path.dirname(os.path.abspath(ckpt)), exist_ok=True)
        tmp = ckpt + ".tmp"
        torch.save({"recipe": recipe, "task": task.state_dict(), "opt": opt.state_dict(), "step": step,
                    "seconds": spent + time.perf_counter() - t_run}, tmp)
        os.replace(tmp, ckpt)

    stop_flag = {"sig": None}

    def on_signal(signum, frame):
        stop_flag["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    t_run = time.perf_counter()
    last_ckpt = t_run
    taus: list[tuple[int, float]] = []
    bar = tqdm(total=total, initial=step, desc=f"train {task.kind}", unit="step", dynamic_ncols=True)
    step0 = step
    n_tok, t_tok = 0, time.perf_counter()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else _Null()
    loss_avg = first_loss = last_loss = None
    epoch_losses: list[float] = []
    stats: dict = {}
    clock_over = False  # --minutes spent: the run ends as if its last epoch had
    try:
        while step < total and not clock_over:
            epoch, pos = divmod(step, per_epoch)
            order = torch.randperm(per_epoch, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
            ids, valid = collate(seqs, batches[order[pos]], cfg.max_len, dev, cfg.pad_multiple)
            feats = target.forward_batch_train(ids, capture=task.capture)
            gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1_000_003 + step)
            task.train()
            with amp:
                loss, stats = task.loss(ids, valid, feats, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, cfg, spent + time.perf_counter() - t_run)
            opt.step()
            step += 1
            n_tok += int(valid.sum())
            lv = float(loss.detach())
            epoch_losses.append(lv)
            loss_avg = lv if loss_avg is None else 0.98 * loss_avg + 0.02 * lv
            bar.update(1)
            now = time.perf_counter()
            left = 60 * cfg.minutes - (spent + now - t_run) if cfg.minutes else None  # seconds on the clock
            clock_over = left is not None and left <= 0
            if left is not None:  # --minutes: the bar's total is what the clock allows at this run's rate so far
                bar.total = step if clock_over else min(total, step + int(max(0.0, left) * (step - step0) / (now - t_run)))
            clock = {} if left is None else {"ends_in": f"{max(0, int(left)) // 60}:{max(0, int(left)) % 60:02d}"}
            bar.set_postfix(loss=f"{loss_avg:.3f}", **{k: f"{float(v):.2f}" for k, v in stats.items() if k in task.show},
                            tok_s=f"{n_tok / max(now - t_tok, 1e-9):.0f}", **clock, refresh=False)
            if step % per_epoch == 0 or step == total or clock_over:
                mean = sum(epoch_losses) / len(epoch_losses)
                first_loss = mean if first_loss is None else first_loss
                last_loss, epoch_losses = mean, []
                tau = held_out_tau(task, target, cfg.eval_prompts, cfg.eval_tokens, loaded.tokenizer.eos_ids
                                   if loaded.tokenizer else [])
                taus.append((step, tau))
                log(f"epoch {step / per_epoch:.2f}: mean loss {mean:.3f}, held-out tau {tau:.2f}")
                save_ckpt()
                last_ckpt = now
            elif now - last_ckpt > 60 * cfg.checkpoint_minutes:
                save_ckpt()
                last_ckpt = now
            over = cfg.time_limit_minutes is not None and (now - t_run) > 60 * cfg.time_limit_minutes
            if (stop_flag["sig"] is not None or over) and step < total and not clock_over:
                save_ckpt()
                why = "the time limit" if over else f"signal {stop_flag['sig']}"
                raise Stopped(f"stopped by {why} at step {step}/{total}; checkpoint {ckpt} "
                              "(rerun the same command to resume)")
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    seconds = spent + time.perf_counter() - t_run
    summary = {"steps": step, "epochs": round(step / per_epoch, 3), "sequences": len(seqs), "reply_tokens": data.reply_tokens,
               "batches_per_epoch": per_epoch, "seconds": round(seconds, 1), "first_epoch_loss": first_loss, "last_epoch_loss": last_loss,
               "held_out_tau": taus, "stats": {k: float(v.detach() if torch.is_tensor(v) else v) for k, v in stats.items()},
               "machine": machine_description(dev), "commit": git_commit()}
    task.save(out, summary)
    if os.path.exists(ckpt):
        os.remove(ckpt)
    return summary


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
