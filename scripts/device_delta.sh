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
ab() {  # LABEL SHAPE TIMEOUT VARIANTS...: ab_flags at context 512, the variants in one process
    local label=$1 shape=$2 t=$3; shift 3
    timeout $(left $t) python scripts/ab_flags.py --shape $shape \
        --context 512 --rounds 3 --reps 10 --no-drafters --variants "$@" --json $W/ab_$label.json > $W/ab_$label.log 2>&1
    echo "== ab $label rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_$label.log | tail -4 | cut -c1-300; save
}
ox() {  # LABEL SHAPE TIMEOUT VARIANTS...: check_oracle_exact.py (plain, then the oracle at tau 6.5, k = 15; equal?)
    local label=$1 shape=$2 t=$3; shift 3
    timeout $(left $t) python scripts/check_oracle_exact.py --shape $shape -n 256 --variants "$@" \
        --json $W/ox_$label.json > $W/ox_$label.log 2>&1
    echo "== oracle $label rc=$? ${SECONDS}s"; tail -2 $W/ox_$label.log | cut -c1-300; save
}
dc() {  # device_check (graphs and eager) on random Qwen3.5 dense and MoE, then the comparison
    timeout $(left 120) python scripts/device_check.py build /tmp/dc > $W/dc_build.log 2>&1
    for t in qwen35 qwen35moe; do
        timeout $(left 70) python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --drafters oracle ngram mtp dflash --prompts 4 --new-tokens 128 --out $W/dc_$t.json > $W/dc_$t.log 2>&1 \
            || echo "dc $t rc=$?"
    done
    timeout $(left 70) python scripts/device_check.py run /tmp/dc --target qwen35moe --mode eager --drafters oracle mtp \
        --prompts 2 --new-tokens 64 --out $W/dc_qwen35moe_eager.json > $W/dc_qwen35moe_eager.log 2>&1 || echo "dc eager rc=$?"
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -14; echo "== dc ${SECONDS}s"; save
}
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
