#!/bin/bash
# A Gated DeltaNet step on position-keyed rings (cache.LinearAttnCache) checked and timed against the tree before them
# (old_tree/specdec: `git archive 74a8df9 specdec | tar -x -C old_tree`, its data/ left out; carried with .whl);
# one device call each:
#   bash scripts/device_delta.sh check  # device_check on random Qwen3.5 dense and MoE (graphs: oracle, n-gram, MTP and
#                                       # DFlash drafts; MoE eager: oracle, MTP); check_oracle_exact.py (the bench's
#                                       # oracle, k = 15) on qwen3.5-35b-a3b and qwen3.5-9b, and on the old tree's 35b
#   bash scripts/device_delta.sh bench  # ab_flags defaults on the 35b shape, this tree and the old one (padded, 1-row
#                                       # and chained steps); specdec bench --shape qwen3.5-35b-a3b and qwen3.5-9b
# Results in $OUT/d.tgz.
set -u
. scripts/device_prelude.sh d  # W=$OUT/d, left, save, bench
ab() {  # LABEL SHAPE TIMEOUT TREE VARIANTS...: ab_flags at context 512 (TREE: a folder whose specdec/ is imported)
    local label=$1 shape=$2 t=$3 tree=$4; shift 4
    PYTHONPATH=/tmp/site:$tree:$PWD/tests:$PWD/scripts timeout $(left $t) python scripts/ab_flags.py --shape $shape \
        --context 512 --rounds 3 --reps 10 --no-drafters --variants "$@" --json $W/ab_$label.json > $W/ab_$label.log 2>&1
    echo "== ab $label rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_$label.log | tail -4 | cut -c1-300; save
}
ox() {  # LABEL SHAPE TIMEOUT TREE: check_oracle_exact.py (plain, then the oracle at tau 6.5, k = 15; equal?)
    local label=$1 shape=$2 t=$3 tree=$4
    PYTHONPATH=/tmp/site:$tree:$PWD/tests:$PWD/scripts timeout $(left $t) python scripts/check_oracle_exact.py \
        --shape $shape -n 256 --json $W/ox_$label.json > $W/ox_$label.log 2>&1
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
    dc
    ox 35b qwen3.5-35b-a3b 110 $PWD
    ox 9b qwen3.5-9b 90 $PWD
    ox 35b_old qwen3.5-35b-a3b 90 $PWD/old_tree ;;
bench)
    ab 35b qwen3.5-35b-a3b 110 $PWD defaults
    ab 35b_old qwen3.5-35b-a3b 110 $PWD/old_tree defaults
    bench qwen3.5-35b-a3b 160 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 110 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_delta.sh check | bench"; exit 2 ;;
esac
save && rm -rf $W
