"""Peak GPU memory and time of one DFlash training step at training shapes.

A random target shaped like SmolLM2-135M (its weights do not matter for memory), random
features, and one forward (:func:`dflash_block_hidden`) + :func:`dflash_loss` + backward of a
5-layer drafter per configuration. Prints one JSON line per configuration; ``--out`` writes them.

    python scripts/dflash_train_memory.py --out mem.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.config import parse_config
from specdec.models.llama import LlamaConfig, LlamaForCausalLM
from specdec.train.dflash_batch import (dflash_block_hidden, dflash_loss, new_dflash_config, new_dflash_model,
                                        sample_anchors)

SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True}


def target(device) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(parse_config(LlamaConfig, dict(SMOLLM2)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model.to(torch.bfloat16).eval()


def step(model, t, b, l, a, mode, chunk, gen):
    bs = model.config.block_size
    feats = torch.randn(b, l, len(model.config.target_layer_ids) * 576, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(49152, (b, l), device="cuda", generator=gen)
    label_valid = torch.ones(b, l, dtype=torch.bool, device="cuda")
    label_valid[:, : l // 4] = False
    anchors, valid = sample_anchors(label_valid, a, bs, gen)
    with torch.autocast("cuda", torch.bfloat16, enabled=mode == "autocast"):
        hid = dflash_block_hidden(model, t.embed_tokens.weight, feats, tokens, anchors, valid, anchor_chunk=chunk)
        loss, stats = dflash_loss(model, hid, t.head_weight(), tokens, anchors, valid, label_valid)
    loss.backward()
    return float(loss.detach()), float(stats["accept_len"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    t = target("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    # (B, L, anchors per sequence, mode, anchor_chunk): B * A * 16 query rows
    for b, l, a, mode, chunk in [(16, 1024, 64, "autocast", None), (16, 1024, 64, "autocast", 16),
                                 (16, 1024, 64, "bf16", None), (8, 2048, 128, "autocast", None),
                                 (8, 2048, 128, "autocast", 32), (32, 1024, 64, "autocast", None)]:
        cfg = new_dflash_config(t, num_layers=5, block_size=16, mask_token_id=0)
        model = new_dflash_model(t, cfg)
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        row = {"B": b, "L": l, "A": a, "query_rows": b * a * 16, "mode": mode, "anchor_chunk": chunk}
        try:
            step(model, t, b, l, a, mode, chunk, gen)  # warm-up
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            loss, acc = step(model, t, b, l, a, mode, chunk, gen)
            torch.cuda.synchronize()
            row.update(ms=round(1e3 * (time.perf_counter() - t0), 1), loss=round(loss, 3),
                       peak_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2))
        except torch.OutOfMemoryError as e:
            row["oom"] = str(e)[:200]
        del model
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
