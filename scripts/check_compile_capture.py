"""Does a compiled target step compute the same bits whatever layers it captures?

The condition for lifting `--compile`'s refusal of DFlash drafters: with compile on, the 16-row
static step that also returns DFlash's layers must give bitwise the logits of the plain step
(capture nothing). For each prompt this decodes the plain greedy continuation with one cache and
replays the same tokens with the other (teacher forcing), comparing every step's logits.

    python scripts/check_compile_capture.py --model M.gguf --dflash DIR [--prompts 10] [-n 128]
"""

import argparse
import json

import torch

from specdec.bench import load_prompts
from specdec.config import read_json
from specdec.loading import load_model
from specdec.models.graphs import GraphedTarget


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dflash", required=True, help="a DFlash drafter directory (its target_layer_ids are captured)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--no-compile", action="store_true", help="the uncompiled steps, for comparison")
    a = ap.parse_args()
    lm = load_model(a.model, a.device, None)
    m, tok = lm.model, lm.tokenizer
    cap = tuple(read_json(f"{a.dflash}/config.json")["dflash_config"]["target_layer_ids"])
    compile_ = not a.no_compile
    caches = {c: m.new_cache(2048, spare=16) for c in ((), cap)}
    steps = {c: GraphedTarget(m, caches[c], c, max_steps=16, pad_to=16, compile=compile_) for c in caches}
    worst, differ, total = 0.0, 0, 0
    for (q,) in load_prompts("gsm8k", a.prompts):
        ids = torch.tensor(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special=False))
        for c in caches:
            caches[c].reset()
            out = m(ids.to(m.device), caches[c], capture=c, logits="last", snapshots=False)
        t = int(out.logits[-1].argmax())
        for _ in range(a.n):
            x = torch.tensor([t], device=m.device)
            la = steps[()](x).logits[-1].clone()
            lb = steps[cap](x).logits[-1]
            total += 1
            if not torch.equal(la, lb):
                differ += 1
                worst = max(worst, float((la - lb).abs().max()))
            t = int(la.argmax())
    res = {"compile": compile_, "capture": list(cap), "steps": total, "steps_differing": differ, "max_abs_diff": worst}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
