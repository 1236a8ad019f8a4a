#!/bin/bash
# The Gated DeltaNet step on the GPU (the one-kernel step, delta_kernel.ONE_KERNEL, against the two kernels); one device
# call each:
#   bash scripts/device_delta.sh check  # check_delta_rows.py (each row's bits against chained 1-row steps, both
#                                       # forms); check_oracle_exact.py (the bench's oracle, k = 15) on qwen3.5-35b-a3b
#                                       # (defaults, defaults-delta-one) and qwen3.5-9b; ab_flags on the 35b shape
#                                       # (padded, 1-row and chained steps); device_check on random Qwen3.5 dense and
#                                       # MoE (graphs: oracle, n-gram, MTP and DFlash drafts; MoE eager: oracle, MTP)
#   bash scripts/device_delta.sh bench  # specdec bench --shape qwen3.5-35b-a3b and qwen3.5-9b
# Results in $OUT/d.tgz.
set -u
. scripts/device_prelude.sh d  # W=$OUT/d, left, save, bench
case "${1:-}" in
check)
    timeout $(left 60) python scripts/check_delta_rows.py > $W/rows.log 2>&1; echo "== rows rc=$? ${SECONDS}s"
    grep -c '"rows_equal_chained": true' $W/rows.log; grep '"rows_equal_chained": false' $W/rows.log | cut -c1-200; save
    ox 35b qwen3.5-35b-a3b 110 defaults defaults-delta-one
    ab 35b qwen3.5-35b-a3b 90 defaults defaults-delta-one
    dc
    ox 9b qwen3.5-9b 70 defaults ;;
bench)
    bench qwen3.5-35b-a3b 160 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 110 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_delta.sh check | bench"; exit 2 ;;
esac
save && rm -rf $W
