#!/bin/bash
# Issue 10, session of 2026-12-06 (third): kernel cuts in the hybrid and q/k-normed targets' steps.
# Ran at 47d91ef (`ab`): ab_flags on qwen3.5-35b-a3b, qwen3-8b and qwen3.5-9b for three cuts, each behind a switch: a MoE
# block's routing in its gate/up kernel (slower, removed), a gated attention's o * sigmoid(gate) as one kernel (mixed,
# removed) and the q/k norms in the RoPE + cache-write kernel (faster: layers.NORM_ROPE, on); BENCHMARKS.md.
#   bash scripts/device_fewer.sh check   # the 35b step's profile and timeline (profile_shape_step.py); device_check on
#                                        # random Qwen3, Qwen3.5 dense and MoE (graphs and eager; oracle, n-gram, MTP,
#                                        # DFlash drafts); bench --shape qwen3.5-35b-a3b (its oracle against plain)
#   bash scripts/device_fewer.sh ab      # ab_flags defaults / defaults-norm-rope on qwen3-8b and qwen3.5-35b-a3b
#   bash scripts/device_fewer.sh router  # the 35b's MoE router GEMM (257 x 2048) swept at 1 row (K split too), then
#                                        # ab_flags defaults / defaults+tiles (the sweep's best); ran at b9fd3f7 with a
#                                        # one-warp routing kernel too (no gain, removed)
#   bash scripts/device_fewer.sh final   # bench --shape: qwen3.5-35b-a3b, qwen3-8b (512, then 4,096 and 16,384), qwen3.5-9b
#                                        # (--draft-vocab 32768), smollm2-135m
#   bash scripts/device_fewer.sh llama   # bench --shape smollm2-135m; device_check on random Llama and Qwen3 (graphs)
# (Its `buckets` case moved to scripts/device_long.sh, session of 2026-12-06 (fourth).)
#   bash scripts/device_fewer.sh compare # after device_stage.sh part1 and join (the real SmolLM2 GGUF at /tmp/smol.gguf;
#                                        # the tree with the shipped drafters): generate --compare with auto, dflash, mtp
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl).
set -u
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ab() {  # NAME TIMEOUT ab_flags args...
    local name=$1 t=$2; shift 2
    timeout $t python scripts/ab_flags.py --context 512 --no-drafters --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^\|" $R/ab_$name.log | cut -c1-150
}
case "${1:-}" in
ab)
    ab 35b 200 --shape qwen3.5-35b-a3b --rounds 3 --variants defaults defaults-norm-rope
    ab 8b 120 --shape qwen3-8b --rounds 3 --variants defaults defaults-norm-rope ;;
check)
    timeout 120 python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --context 512 --rows 1 \
        --timeline $R/timeline35b.json > $R/prof35b.json 2> $R/prof35b.err; echo "profile rc=$?"
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in qwen3 qwen35 qwen35moe; do
        for m in graphs eager; do
            timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode $m --drafters oracle ngram mtp dflash \
                --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > $R/dc_${t}_$m.log 2>&1 || echo "$t $m rc=$?"
        done
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -6
    timeout 170 python -m specdec bench --shape qwen3.5-35b-a3b --context 512 --oracle-tau 6.5 --draft-vocab 32768 \
        --reps 10 --json $R/b35b.json > $R/b35b.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b35b.log | tail -7 ;;
router)
    timeout 150 python scripts/check_fused_layer.py --shape qwen3.5-35b-a3b --only router --sweep --rows 1 --no-model \
        --json $R/sweep_router.json > $R/sweep_router.log 2>&1; echo "sweep rc=$?"; grep -E "router|failed" $R/sweep_router.log | tail -4
    export AB_TILES=$(python -c "import json; print(json.dumps(json.load(open('$R/sweep_router.json'))['best_tiles']))")
    echo "AB_TILES=$AB_TILES"
    ab 35b_router 200 --shape qwen3.5-35b-a3b --rounds 3 --variants defaults defaults+tiles ;;
final)
    bench() {  # NAME CONTEXT [bench args]: the log's summary lines
        local name=$1 ctx=$2; shift 2
        timeout 200 python -m specdec bench --shape $name --context $ctx --oracle-tau 6.5 --json $R/b_${name}_$ctx.json "$@" \
            > $R/b_${name}_$ctx.log 2>&1
        echo "== $name $ctx rc=$?"; grep -vE "^ *(verify|k=)" $R/b_${name}_$ctx.log | tail -9 | cut -c1-260
    }
    bench qwen3.5-35b-a3b 512 --draft-vocab 32768 --reps 10
    bench qwen3-8b 512 --contexts 4096,16384 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 512 --draft-vocab 32768 --reps 10
    bench smollm2-135m 512 ;;
llama)
    timeout 120 python -m specdec bench --shape smollm2-135m --context 512 --oracle-tau 6.5 --json $R/b_smollm2.json \
        > $R/b_smollm2.log 2>&1; echo "bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b_smollm2.log | tail -9 | cut -c1-260
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen3; do
        timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode graphs --drafters oracle ngram dflash \
            --prompts 4 --new-tokens 128 --out $R/dc_${t}_graphs.json > $R/dc_${t}_graphs.log 2>&1 || echo "$t rc=$?"
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -8 ;;
compare)
    [ -s /tmp/smol.gguf ] || { echo "device_fewer.sh compare: no /tmp/smol.gguf (run device_stage.sh part1 and join)"; exit 2; }
    q="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
    for d in auto dflash mtp; do
        echo "== --draft $d"; timeout 100 python -m specdec generate -m /tmp/smol.gguf --draft $d --compare --chat -n 256 "$q" 2>&1 | tail -8
    done > $R/compare.log
    grep -v "^\s*$" $R/compare.log | tail -30 ;;
*)
    echo "device_fewer.sh: check | ab | router | final | llama | compare"; exit 2 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
