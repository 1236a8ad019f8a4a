"""Sampled (T=1) speculative decoding with random DFlash and MTP drafters on the SmolLM2 shape (random
weights, CUDA): that each drafter's static steps take their fused-kernel path there (drafters/dflash_fast.py,
mtp.FastLayer) in a sampled generation and run to the end with valid token ids. A smoke run for the GPU
(random weights say nothing of tau); the statistical tests of sampled output are in the CPU suite.

    python scripts/smoke_sampled_drafters.py
"""

import sys

import torch

from specdec.bench_shape import _dflash, _mtp
from specdec.engine import SpeculativeGenerator
from specdec.sampling import SamplingParams
from specdec.shapes import build_shape


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("smoke_sampled_drafters.py: needs a CUDA device (the fused-kernel paths are CUDA only)")
    m = build_shape("smollm2-135m", torch.device("cuda"), torch.bfloat16)
    p = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    for name, make in (("dflash", _dflash), ("mtp", _mtp)):
        d, k, _ = make(m)
        r = SpeculativeGenerator(m, d, k).generate(p, 128, SamplingParams(temperature=1.0, seed=1))
        fast = getattr(d, "_fast_w", None) is not None or getattr(d, "_fast_layer", None) is not None
        print(name, "sampled T=1:", len(r.token_ids), "tokens, tau", round(r.stats.tau, 2), "fast path", fast,
              "ids in range", all(0 <= t < m.config.vocab_size for t in r.token_ids))


if __name__ == "__main__":
    main()
