"""Does eager SDPA pay a one-off setup for each new sequence length on this GPU? (issue 9: MTP k=3
cost ~110 ms more per prompt than k=4, which runs the same prompt right after it; the guess is a
per-shape setup in the drafter's eager catch-up over the prompt, e.g. a cuDNN attention plan.)
Times the first call per length (SmolLM2's heads, a causal boolean mask, GQA): default backends,
cuDNN excluded, cuDNN only.

    python scripts/probe_sdpa_first_call.py
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def first_call_ms(length: int, backends=None) -> float:
    q = torch.randn(1, 9, length, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, length, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(length, length, device="cuda", dtype=torch.bool).tril()
    torch.cuda.synchronize()
    t = time.perf_counter()
    if backends is None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1e3, 2)


def main() -> None:
    print(torch.__version__, "cudnn_sdp enabled:", torch.backends.cuda.cudnn_sdp_enabled())
    first_call_ms(64)
    print("default, ms:", [first_call_ms(n) for n in (101, 117, 133, 101, 117, 149)])
    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    print("no cuDNN, ms:", [first_call_ms(n, no_cudnn) for n in (161, 177, 193, 161, 209)])
    print("cuDNN only, ms:", [first_call_ms(n, [SDPBackend.CUDNN_ATTENTION]) for n in (225, 241, 225)])


if __name__ == "__main__":
    main()
