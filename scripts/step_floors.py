"""Bytes a step reads (bf16), counted on the shapes' meta models (no weights allocated): the floors under issue 10's
drafter targets, as ratios to a decode step's bytes (what a step costs against decode when both run at the same
fraction of the memory bandwidth).

    PYTHONPATH=. python scripts/step_floors.py

qwen3-8b: a DFlash propose of 5 target-shaped layers, the fc (5h -> h) and the head over N vocabulary rows.
qwen3.5-35b-a3b: a verify of r rows under random routing (the shape's random router: each row's top-8 of 256
independent, so r rows touch 256 (1 - (1 - 8/256)^r) experts a layer), and an MTP K=3 step (three proposals of a
one-layer MoE block with its head, then the 4-row verify). Trained routers route neighbouring tokens to shared
experts, which these counts do not model. KV bytes are left out (75 MB for qwen3-8b at 512 tokens).
"""

from __future__ import annotations

import torch

from specdec.shapes import meta_model, param_count

BYTES = 2  # bf16


def floors(name: str) -> dict:
    """Parameter counts (not bytes) a step reads, and their ratios to decode's."""
    m = meta_model(name, None).to(torch.bfloat16)
    c = m.config
    head = m.embed_tokens.weight.numel()  # the head's rows x width (tied or not: the same matrix size)
    decode = param_count(m) - (head if m.lm_head is not None else 0)  # an untied embedding table: one row read
    out = {"shape": name, "decode": decode, "head": head}
    experts_n = getattr(c, "num_experts", 0)
    if not experts_n:
        layer = (decode - head) / len(m.layers)
        for vocab in (c.vocab_size, 32768, 16384):
            d = 5 * layer + 5 * c.hidden_size * c.hidden_size + vocab * c.hidden_size
            out[f"dflash_propose_{vocab}"] = d / decode
        return out
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    k, layers = c.num_experts_per_tok, len(m.layers)
    per_expert = experts / (experts_n * layers)
    non_expert = decode - experts
    decode = non_expert + experts * k / experts_n
    out.update(decode=decode, expert=per_expert)

    def verify(rows: int) -> float:
        return non_expert + experts_n * (1 - (1 - k / experts_n) ** rows) * per_expert * layers

    for rows in (2, 4, 5, 16):
        out[f"verify_{rows}"] = verify(rows) / decode
    layer = (non_expert - head) / layers  # the mean non-expert layer (attention or DeltaNet, shared expert)
    for vocab in (c.vocab_size, 32768):
        drafts = 3 * (layer + per_expert * k + 2 * c.hidden_size * c.hidden_size + vocab * c.hidden_size)
        out[f"mtp_k3_{vocab}"] = (drafts + verify(4)) / decode
    return out


def main() -> None:
    for name in ("qwen3-8b", "qwen3.5-35b-a3b"):
        f = floors(name)
        print(f"{name}: decode reads {f['decode'] * BYTES / 1e9:.2f} GB (head {f['head'] * BYTES / 1e9:.2f} GB)")
        for key, v in f.items():
            if key.startswith(("dflash", "verify", "mtp")):
                print(f"  {key}: {v:.3f}x decode")


if __name__ == "__main__":
    main()
