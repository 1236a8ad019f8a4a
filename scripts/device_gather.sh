#!/bin/bash
# The token embeddings' and RoPE tables' lookups by indexing (layers.INDEX_LOOKUPS) against index_select, whose CUDA
# kernel walks a 16-row step's ids one after another; one device call each (carry .whl):
#   bash scripts/device_gather.sh ab      # ab_flags defaults / defaults+index-select (one process a shape): smollm2-135m,
#                                         # gemma3-270m, qwen3-8b (padded 16-row and 1-row steps, drafter proposes);
#                                         # device_check on random Llama, Qwen3.5 and Gemma 3 (graphs; oracle, n-gram,
#                                         # MTP and DFlash drafts), as the call's time allows
#   bash scripts/device_gather.sh profile # the smollm2-135m shape's 16-row step's kernels (profile_shape_step.py
#                                         # --timeline) and its bench, lookups by indexing and by index_select, alternated
#   bash scripts/device_gather.sh bench   # specdec bench --shape smollm2-135m, qwen3-8b, qwen3.5-9b, qwen3.5-35b-a3b
# (A mode `resident` timed a register-resident GEMM form in the session of 2026-12-07 (fifteenth): slower, removed with
# it; BENCHMARKS.md.)
# Results in $OUT/g.tgz.
set -u
. scripts/device_prelude.sh g  # W=$OUT/g, left, save, bench
cat > /tmp/gather_off.py <<'PY'
# python /tmp/gather_off.py MODULE|SCRIPT.py ARGS...: run it with layers.INDEX_LOOKUPS off (index_select)
import runpy, sys
import specdec.models.layers as layers
layers.INDEX_LOOKUPS = False
sys.argv = sys.argv[1:]
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    runpy.run_module(sys.argv[0], run_name="__main__")
PY
case "${1:-}" in
ab)
    ab() {  # SHAPE ROUNDS [ab_flags args]
        local s=$1 r=$2; shift 2
        timeout $(left 200) python scripts/ab_flags.py --shape $s --context 512 --rounds $r --reps 10 \
            --variants defaults defaults+index-select --json $W/ab_$s.json "$@" > $W/ab_$s.log 2>&1
        echo "== ab $s rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_$s.log | tail -3 | cut -c1-300; save
    }
    ab smollm2-135m 4
    ab gemma3-270m 3
    ab qwen3-8b 3
    timeout $(left 120) python scripts/device_check.py build /tmp/dc > $W/dc_build.log 2>&1
    for t in llama qwen35 gemma3; do
        timeout $(left 60) python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --drafters oracle ngram mtp dflash --prompts 4 --new-tokens 128 --out $W/dc_$t.json > $W/dc_$t.log 2>&1 \
            || echo "dc $t rc=$?"
    done
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -8; echo "== dc ${SECONDS}s" ;;
profile)
    for i in 1 2; do
        for v in on off; do
            P="scripts/profile_shape_step.py --shape smollm2-135m --rows 16 --context 512 --top 12 --timeline $W/tl_${v}_$i.json"
            [ $v = on ] && X= || X=/tmp/gather_off.py
            timeout $(left 60) python $X $P > $W/prof_${v}_$i.log 2>&1
            echo "== profile $v $i rc=$? ${SECONDS}s $(grep -m1 captured_ms $W/prof_${v}_$i.log)"
        done
    done; save
    for v in on off; do
        [ $v = on ] && X=-m || X=/tmp/gather_off.py
        timeout $(left 90) python $X specdec bench --shape smollm2-135m --context 512 --oracle-tau 6.5 \
            --json $W/b_smollm2_$v.json > $W/b_smollm2_$v.log 2>&1
        echo "== bench $v rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_smollm2_$v.log | tail -7 | cut -c1-240; save
    done ;;
bench)
    bench smollm2-135m 60
    bench qwen3-8b 150 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 120 --draft-vocab 32768 --reps 10
    bench qwen3.5-35b-a3b 150 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_gather.sh ab | profile | bench"; exit 2 ;;
esac
save && rm -rf $W
