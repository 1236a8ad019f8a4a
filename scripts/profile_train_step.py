"""Where a DFlash training step's time goes (issue 9: `specdec train` ran 2.7 steps/s, 30k target
tokens/s, on the H200 with SmolLM2-135M, 128 anchors; scripts/dflash_train_memory.py had timed the
drafter's forward + loss + backward alone at 60 ms for 64 anchors).

A random target shaped like SmolLM2-135M (bf16) and a 5-layer drafter (fp32 under bf16 autocast),
batches shaped like the trainer's (sequences of ragged length grouped under ``--batch-tokens``),
each phase of a step timed with a device sync around it: the target's features, the anchors, the
drafter's blocks, the loss, the backward, clipping and AdamW. Lengths change every step (as the
trainer's do) or stay fixed (``--fixed``), with cuDNN's attention allowed or not, so a plan built
per new shape shows. Then a torch.profiler table of the heaviest kernels of a few steps.

    python scripts/profile_train_step.py --steps 12 --anchors 128 --out prof.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))

from dflash_train_memory import target  # noqa: E402
from specdec.train.dflash_batch import (dflash_block_hidden, dflash_loss, new_dflash_config,  # noqa: E402
                                        new_dflash_model, sample_anchors, trim_anchors)


def batch(gen: torch.Generator, batch_tokens: int, length: int, dev):
    """Right-padded ids ``[B, L]`` and reply mask as the trainer collates them: a prompt of ~1/3."""
    b = max(1, batch_tokens // length)
    ids = torch.randint(49152, (b, length), generator=gen).to(dev)
    valid = torch.zeros(b, length, dtype=torch.bool)
    ends = torch.randint(length // 2, length + 1, (b,), generator=gen)
    for r in range(b):
        valid[r, length // 3: int(ends[r])] = True
    return ids, valid.to(dev)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(t, model, opt, steps: int, lengths: list[int], anchors: int, batch_tokens: int, sync: bool) -> dict:
    dev = t.device
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(0)
    phases = {k: 0.0 for k in ("features", "anchors", "blocks", "loss", "backward", "optimiser")}
    capture = tuple(model.config.target_layer_ids)
    n_tok = 0

    def mark(name, t0):
        if sync:
            _sync(dev)
            now = time.perf_counter()
            phases[name] += now - t0
            return now
        return t0

    _sync(dev)
    start = time.perf_counter()
    for s in range(steps):
        ids, valid = batch(gen, batch_tokens, lengths[s % len(lengths)], dev)
        n_tok += int(valid.sum())
        t0 = time.perf_counter()
        feats = t.forward_batch_train(ids, capture=capture)
        t0 = mark("features", t0)
        a, ok = trim_anchors(*sample_anchors(valid, anchors, model.config.block_size, generator=dgen))
        t0 = mark("anchors", t0)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h = dflash_block_hidden(model, t.embed_tokens.weight, feats.captured, ids, a, ok)
            t0 = mark("blocks", t0)
            loss, _ = dflash_loss(model, h, t.head_weight(), ids, a, ok, valid)
            t0 = mark("loss", t0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t0 = mark("backward", t0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        float(loss.detach())
        mark("optimiser", t0)
    _sync(dev)
    total = time.perf_counter() - start
    out = {"ms_per_step": round(1e3 * total / steps, 1), "reply_tok_s": round(n_tok / total)}
    if sync:
        out["phase_ms"] = {k: round(1e3 * v / steps, 1) for k, v in phases.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny --steps)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.steps < 1 or args.anchors < 1 or args.batch_tokens < 1:
        ap.error("--steps, --anchors and --batch-tokens must be >= 1")
    t = target(args.device)
    if t.device.type == "cpu":
        t = t.float()
    cfg = new_dflash_config(t, num_layers=5, block_size=16, mask_token_id=0)
    model = new_dflash_model(t, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    ragged = [200 + 8 * i for i in range(64)]  # a new padded length every step, as the trainer's batches
    rows = []
    for cudnn in (True, False) if t.device.type == "cuda" else (False,):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for name, lengths in (("fixed_384", [384]), ("ragged", ragged)):
            run(t, model, opt, 2, lengths[-2:] if name == "fixed_384" else [1000, 1008], args.anchors,
                args.batch_tokens, False)  # warm-up (not the lengths timed when ragged)
            for sync in (False, True):
                r = run(t, model, opt, args.steps, lengths, args.anchors, args.batch_tokens, sync)
                r.update(cudnn_sdp=cudnn, lengths=name, phases_synced=sync, anchors=args.anchors)
                print(json.dumps(r), flush=True)
                rows.append(r)
    torch.backends.cuda.enable_cudnn_sdp(True)
    from torch.profiler import ProfilerActivity, profile
    run(t, model, opt, 2, [384], args.anchors, args.batch_tokens, False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if t.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run(t, model, opt, 3, [384], args.anchors, args.batch_tokens, False)
    table = prof.key_averages().table(sort_by="cuda_time_total" if t.device.type == "cuda" else "cpu_time_total", row_limit=25, max_name_column_width=70)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "profile": table}, f, indent=1)


if __name__ == "__main__":
    main()
