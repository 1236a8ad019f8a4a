#!/bin/bash
# Session of 2026-12-06 (seventh), issue 10: SPECDEC_GEMM_PROLOGUE (fused_layer.linear's gate / gnorm prologues) on the
# device machine. Needs the gguf wheel (carry .whl); no checkpoint.
#   bash scripts/device_prologue.sh ab      # the prologues' values against the kernels they replace at the shapes'
#                                           # sizes (bf16, 1-16 rows: max difference, bits differing, a row's bits alone
#                                           # among 16); ab_flags on qwen3.5-35b-a3b and qwen3.5-9b at 512: defaults,
#                                           # + the gate, + the norm, + both (1-row and padded steps, 3 rounds)
#   bash scripts/device_prologue.sh check   # device_check with SPECDEC_GEMM_PROLOGUE=1 (random Qwen3.5 dense and MoE,
#                                           # graphs and eager; oracle and MTP drafts) against plain decoding
#   bash scripts/device_prologue.sh bench   # bench --shape qwen3.5-35b-a3b and qwen3.5-9b at 512 (as the session of
#                                           # 2026-12-06 (third)) with the tree's defaults
# Results in $OUT/r.tgz.
set -u
case "${1:-}" in ab|check|bench) ;; *) echo "device_prologue.sh: ab | check | bench"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "$1" in
ab)
    python - <<'PY' 2>&1 | tee $R/prologue_values.log
import torch
from specdec.models import delta_kernel, fused_layer as fl
torch.manual_seed(0)
dt, dev = torch.bfloat16, "cuda"
for name, n, h, d in (("35b out_proj", 2048, 32, 128), ("9b out_proj", 4096, 32, 128)):
    w = (torch.randn(n, h * d, device=dev) * (h * d) ** -0.5).to(dt)
    nw = (torch.rand(d, device=dev) + 0.5).to(dt)
    o = torch.randn(16, h, d, device=dev)
    zp = torch.randn(16, 3 * h * d, device=dev).to(dt)
    z = zp[:, h * d:2 * h * d].unflatten(-1, (h, d))
    full = fl.linear(o, w, gnorm=(z, nw, 1e-6))
    for t in (1, 4, 16):
        ref = fl.linear(delta_kernel.gated_norm(o[:t], zp[:t, h * d:2 * h * d], nw, 1e-6), w)
        got = fl.linear(o[:t], w, gnorm=(z[:t], nw, 1e-6))
        print(f"{name} gnorm rows {t}: max diff {(got.float() - ref.float()).abs().max().item():.2e}, outputs differing "
              f"{(got != ref).sum().item()} of {got.numel()}; rows as among 16: {torch.equal(got, full[:t])}")
for name, n, h, d in (("35b o_proj", 2048, 16, 256), ("9b o_proj", 4096, 16, 256)):
    w = (torch.randn(n, h * d, device=dev) * (h * d) ** -0.5).to(dt)
    o = torch.randn(h, 16, d, device=dev).to(dt).transpose(0, 1)
    g = torch.randn(16, h, 2 * d, device=dev).to(dt)[..., d:]
    full = fl.linear(o, w, gate=g)
    for t in (1, 4, 16):
        ref = fl.linear((o[:t] * torch.sigmoid(g[:t])).reshape(t, h * d), w)
        got = fl.linear(o[:t], w, gate=g[:t])
        print(f"{name} gate rows {t}: max diff {(got.float() - ref.float()).abs().max().item():.2e}, outputs differing "
              f"{(got != ref).sum().item()} of {got.numel()}; rows as among 16: {torch.equal(got, full[:t])}")
PY
    ab() {  # NAME TIMEOUT ab_flags args...
        local name=$1 t=$2; shift 2
        timeout $t python scripts/ab_flags.py --context 512 --no-drafters --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
        echo "== $name rc=$?"; grep -E "^\||Error" $R/ab_$name.log | cut -c1-200
    }
    V="defaults defaults+gate-pro defaults+norm-pro defaults+gate-pro+norm-pro"
    ab 35b 260 --shape qwen3.5-35b-a3b --rounds 3 --variants $V
    ab 9b 200 --shape qwen3.5-9b --rounds 3 --variants $V ;;
check)
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in qwen35 qwen35moe; do
        for m in graphs eager; do
            SPECDEC_GEMM_PROLOGUE=1 timeout 90 python scripts/device_check.py run /tmp/dc --target $t --mode $m \
                --drafters oracle mtp --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > $R/dc_${t}_$m.log 2>&1 \
                || echo "$t $m rc=$?"
        done
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -10 ;;
bench)
    for s in qwen3.5-35b-a3b qwen3.5-9b; do
        timeout 250 python -m specdec bench --shape $s --context 512 --oracle-tau 6.5 --draft-vocab 32768 --reps 10 \
            --json $R/b_$s.json > $R/b_$s.log 2>&1
        echo "== $s rc=$?"; grep -vE "^ *(verify|k=)" $R/b_$s.log | tail -6 | cut -c1-260
    done ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
