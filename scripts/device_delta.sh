#!/bin/bash
# A Gated DeltaNet step on position-keyed rings, its conv, gates and recurrence in one kernel (delta_kernel.ONE_KERNEL)
# against the two kernels, and against the tree before the rings (old_tree/specdec: `git archive 74a8df9 specdec | tar
# -x -C old_tree`, carried); one device call each (carry .whl and old_tree):
#   bash scripts/device_delta.sh check  # ab_flags on the qwen3.5-35b-a3b shape: defaults / defaults-delta-one /
#                                       # defaults-delta-early (--no-drafters; padded, 1-row and chained steps), then
#                                       # the old tree's defaults (another process); device_check on random Qwen3.5
#                                       # dense and MoE (graphs: oracle, n-gram, MTP and DFlash drafts; MoE eager:
#                                       # oracle, MTP)
#   bash scripts/device_delta.sh bench  # the 35b shape's 1-row step's kernels (profile_shape_step.py --timeline); the
#                                       # old tree's and this tree's ab_flags defaults on qwen3.5-9b; specdec bench
#                                       # --shape qwen3.5-35b-a3b and qwen3.5-9b
#   bash scripts/device_delta.sh once   # where one call is all there is: ab_flags defaults / defaults-delta-one on the
#                                       # 35b shape, device_check, the old tree's defaults, then the 35b shape's bench
# Results in $OUT/d.tgz.
set -u
. scripts/device_prelude.sh d  # W=$OUT/d, left, save, bench
ab() {  # LABEL SHAPE TIMEOUT TREE VARIANTS...: ab_flags at context 512 (TREE: a folder whose specdec/ is imported)
    local label=$1 shape=$2 t=$3 tree=$4; shift 4
    PYTHONPATH=/tmp/site:$tree:$PWD/tests:$PWD/scripts timeout $(left $t) python scripts/ab_flags.py --shape $shape \
        --context 512 --rounds 3 --reps 10 --no-drafters --variants "$@" --json $W/ab_$label.json > $W/ab_$label.log 2>&1
    echo "== ab $label rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_$label.log | tail -5 | cut -c1-300; save
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
    ab 35b qwen3.5-35b-a3b 290 $PWD defaults defaults-delta-one defaults-delta-early
    ab 35b_old qwen3.5-35b-a3b 130 $PWD/old_tree defaults
    dc ;;
bench)
    timeout $(left 120) python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --rows 1 --context 512 --top 14 \
        --timeline $W/tl35.json > $W/prof35.log 2>&1
    echo "== profile rc=$? ${SECONDS}s $(grep -m1 captured_ms $W/prof35.log)"; save
    ab 9b_old qwen3.5-9b 90 $PWD/old_tree defaults
    ab 9b qwen3.5-9b 110 $PWD defaults defaults-delta-one
    bench qwen3.5-35b-a3b 150 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 110 --draft-vocab 32768 --reps 10 ;;
once)  # where one call is all there is: the one-kernel A/B, device_check, the old tree, then the 35b bench
    ab 35b qwen3.5-35b-a3b 250 $PWD defaults defaults-delta-one
    dc
    ab 35b_old qwen3.5-35b-a3b 120 $PWD/old_tree defaults
    bench qwen3.5-35b-a3b 150 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_delta.sh check | bench | once"; exit 2 ;;
esac
save && rm -rf $W
