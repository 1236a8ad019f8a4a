"""Does eager SDPA pay a one-off setup for each new sequence length on this GPU? (issue 9: MTP k=3
cost ~110 ms more per prompt than k=4, which runs the same prompt right after it; the guess is a
per-shape setup in the drafter's eager catch-up over the prompt, e.g. a cuDNN attention plan.)
Times the first call per length: default backends, cuDNN excluded, cuDNN only.

    python scripts/probe_sdpa_first_call.py
"""
import time, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
print(torch.__version__, "cudnn_sdp", torch.backends.cuda.cudnn_sdp_enabled())
def run(L, ctx=None):
    q = torch.randn(1, 9, L, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, L, 64, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    m = torch.ones(L, L, device="cuda", dtype=torch.bool).tril()
    torch.cuda.synchronize(); t = time.perf_counter()
    if ctx is None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    else:
        with sdpa_kernel(ctx):
            F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    torch.cuda.synchronize(); return (time.perf_counter() - t) * 1e3
run(64)
print("default ms:", [round(run(L), 2) for L in (101, 117, 133, 101, 117, 149)])
print("no cudnn ms:", [round(run(L, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]), 2) for L in (161, 177, 193, 161, 209)])
print("cudnn only ms:", [round(run(L, [SDPBackend.CUDNN_ATTENTION]), 2) for L in (225, 241, 225)])
