"""The Gated DeltaNet step kernels alone on the GPU, at the qwen3.5-35b-a3b shape's sizes: a T-row step's rows
(T = 4, 16) against T chained 1-row steps from the same caches, for the one-kernel step (delta_kernel.step) and the
two kernels (conv_gates, recurrent_into_cache), the start an int (eager) and a device tensor with ``live`` (graphs):
whether every row's output, the conv ring and the state ring are bit-equal (a row's bits must not depend on the
step's row count), and how far the two forms' outputs are apart (not bit-equal: other reductions).

    python scripts/check_delta_rows.py

It found why the one-kernel step's speculative output differed from plain decoding (2026-12-07 (eighteenth)):
Triton's build for T == 1 gave row 0 other bits (~1e-9) than the general build; T is now unspecialised.
"""
import json

import torch

from specdec.models import delta_kernel as cur

HK, HV, DK, DV, KS, R = 16, 32, 128, 128, 4, 16
C = 2 * HK * DK + HV * DV
NC, NS, S = KS - 1 + R, R + 1, 37


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("check_delta_rows: needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)

    def r(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt).to(dev)

    conv0, states0 = r(NC, C), r(NS, HV, DK, DV, dt=torch.float32, scale=0.1)
    conv_w, a_log, dt_bias = r(C, KS, dt=torch.float32, scale=0.3), r(HV, scale=0.5), r(HV)

    def one(proj, b, a, conv, st, start, live):
        return cur.step(proj, conv, st, start, live, conv_w, b, a, a_log, dt_bias, HK, HV, DK, DV)

    def two(proj, b, a, conv, st, start, live):
        q, k, v, gg, beta = cur.conv_gates(proj, conv, start, conv_w, b, a, a_log, dt_bias, HK, HV, DK, DV)
        return cur.recurrent_into_cache(q, k, v, gg, beta, st, start, live)

    for T in (4, 16):
        proj, b, a = r(T, C), r(T, HV), r(T, HV)
        outs = {}
        for name, f in (("one", one), ("two", two)):
            for mode in ("int", "tensor"):  # an eager step's start, a static step's (with live)
                conv, st = conv0.clone(), states0.clone()
                start = S if mode == "int" else torch.tensor(S, device=dev)
                live = None if mode == "int" else torch.tensor(T, device=dev)
                full = f(proj, b, a, conv, st, start, live)
                conv_f, st_f = conv, st
                conv, st = conv0.clone(), states0.clone()
                rows = []
                for i in range(T):
                    si = S + i if mode == "int" else torch.tensor(S + i, device=dev)
                    li = None if mode == "int" else torch.tensor(1, device=dev)
                    rows.append(f(proj[i:i + 1], b[i:i + 1], a[i:i + 1], conv, st, si, li))
                rows = torch.cat(rows)
                diff = (full - rows).abs().amax(dim=(1, 2))
                bad = [i for i in range(T) if diff[i] > 0]
                out = {"rows_equal_chained": bool(torch.equal(full, rows)), "first_bad_row": bad[0] if bad else None,
                       "max_diff": float(diff.max()), "conv_rings_equal": bool(torch.equal(conv_f, conv)),
                       "states_equal": bool(torch.equal(st_f, st))}
                outs[name] = full
                print(f"T{T}_{name}_{mode}", json.dumps(out), flush=True)
        print(f"T{T} one vs two", float((outs["one"] - outs["two"]).abs().max()), flush=True)


if __name__ == "__main__":
    main()
