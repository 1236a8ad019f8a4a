"""Debug: compiled static steps on CUDA with a random SmolLM2-shape target (no weights needed).
Runs plain decoding compiled / uncompiled and DFlash (random) compiled, printing each outcome."""
import os
import sys
import traceback

import torch

from specdec.bench_shape import _dflash
from specdec.engine import SpeculativeGenerator
from specdec.shapes import build_shape

if "--no-fuse" in sys.argv:  # the projections left unfused (to tell whether fusion matters)
    from specdec.models.base import CausalLM
    CausalLM.fuse_projections = lambda self: None
only = [a for a in sys.argv[1:] if not a.startswith("--")]
dev = torch.device("cuda")
m = build_shape("smollm2-135m", dev, torch.bfloat16)
prompt = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
ref = None
for name, compile_, drafted in [("plain", False, False), ("plain+compile", True, False),
                                ("dflash", False, True), ("dflash+compile", True, True)]:
    if only and name not in only:
        continue
    try:
        d, k = (None, 0)
        if drafted:
            d, k, _ = _dflash(m)
        g = SpeculativeGenerator(m, d, k, batch_invariant=True, compile=compile_)
        out = g.generate(prompt, 48).token_ids
        torch.cuda.synchronize()
        ref = ref or out
        print(name, "ok", "same" if out == ref else "DIFFERS", out[:8], flush=True)
    except Exception:
        print(name, "FAILED", flush=True)
        traceback.print_exc(limit=12)
        sys.exit(1)
