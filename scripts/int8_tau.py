"""What int8 weight rows (``--draft-int8``) do to a DFlash drafter's acceptance, measured on the CPU: the drafter as
it is against a copy whose every linear weight and draft-vocabulary row holds its int8 rows' values
(``fused_layer.Int8Rows``: what the CUDA kernels multiply, up to their fp32 sums), greedy, on the same prompts one
after the other; tau of each and whether their outputs equal plain decoding's. (``--draft-int8`` itself runs on
CUDA only; this is its arithmetic on the eager CPU path.)

    python scripts/int8_tau.py [--dataset gsm8k] [--num-prompts 20] [-n 128] [--json F]
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.api import default_model_path
from specdec.bench import load_prompts
from specdec.drafters.factory import make_drafter
from specdec.engine import SpeculativeGenerator
from specdec.loading import load_model
from specdec.models.fused_layer import Int8Rows, int8_values_
from specdec.sampling import SamplingParams


def int8_values(loaded):
    """The shipped DFlash drafter for ``loaded``, its linear weights and draft-vocabulary rows holding their int8
    rows' values."""
    d = make_drafter("dflash", loaded)
    int8_values_(d.model)
    if d.vocab is not None:
        d.vocab.rows = Int8Rows.of(d.vocab.rows).dequantized(d.vocab.rows.dtype)
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    loaded = load_model(a.model or default_model_path(), "cpu", None)
    tok = loaded.tokenizer
    base = make_drafter("dflash", loaded)
    gens = {"none": SpeculativeGenerator(loaded.model, None, 0),
            "dflash": SpeculativeGenerator(loaded.model, base, base.block_size - 1),
            "dflash int8 values": SpeculativeGenerator(loaded.model, int8_values(loaded), base.block_size - 1)}
    stats = {k: {"tokens": 0, "steps": 0, "outputs": []} for k in gens}
    for turns in load_prompts(a.dataset, a.num_prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": turns[0]}]), add_special=False)
        for name, g in gens.items():
            r = g.generate(ids, a.n, SamplingParams(), eos_ids=tok.eos_ids)
            s = stats[name]
            s["tokens"] += r.stats.new_tokens
            s["steps"] += r.stats.steps
            s["outputs"].append(r.token_ids)
    rep = {"model": loaded.path, "dataset": a.dataset, "prompts": a.num_prompts, "max_new_tokens": a.n}
    for name, s in stats.items():
        rep[name] = {"tau": round(s["tokens"] / max(s["steps"], 1), 3),
                     "outputs_differing_from_none": sum(x != y for x, y in zip(s["outputs"], stats["none"]["outputs"]))}
    print(json.dumps(rep, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
