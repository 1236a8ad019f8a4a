#!/bin/bash
# Issue 10, session of 2026-12-06 (fourth): attention at long context on the qwen3-8b shape (heads of 128), and the span
# buckets (graphs.SPAN_BUCKETS). Call 1 ran scripts/device_fewer.sh with a first form of `sweep_split_attention.py --long`
# (split keys x query tile x block x warps at one split size; BENCHMARKS.md) and ab_flags on the buckets.
#   bash scripts/device_long.sh schedule  # sweep_split_attention.py --long (tiles x split schedules, 1 and 16 rows at 512,
#                                         # 4k, 16k live keys); bench --shape qwen3-8b --contexts 4096,16384 with buckets on
#   bash scripts/device_long.sh split128  # ab_flags on qwen3-8b: at 16,000 live keys defaults / defaults-small-tiles
#                                         # (64-row tiles for heads of 128) / defaults+far0 (one split size); at 512
#                                         # defaults / defaults-small-tiles; device_check on random Llama and Qwen3 (graphs
#                                         # and eager; oracle, n-gram, DFlash drafts, MTP on Qwen3); check_split_attention
#                                         # (a row's bits at a doubled span, alone, in a batch of one; spans to 8,192)
#   bash scripts/device_long.sh probe     # profile_engine --draft oracle (k 15) on qwen3-8b and smollm2-135m (the engine's
#                                         # time around the verify); the 35b's out/o_proj (2048 x 4096) swept at 1 row
#                                         # (check_fused_layer NARROW_SWEEP, K split too) and its MoE kernels' tiles
#                                         # (sweep_moe_kernel.py)
#   bash scripts/device_long.sh dflash    # profile_shape_step --drafter dflash on qwen3-8b (its propose's kernels)
#   bash scripts/device_long.sh wide      # check_dflash_fast.py on qwen3-8b and qwen3.5-9b (a 4096-wide drafter's fast
#                                         # steps against its eager block; tok/s with them on and off); bench --shape
#                                         # qwen3-8b and qwen3.5-9b (their DFlash propose on the fast steps)
#   (call 13's `gate` case, with layers.GATE_FOLD, is at 7cb7b8e: the fold was removed after it, no gain)
#   bash scripts/device_long.sh final     # bench --shape qwen3-8b (512, then 4,096 and 16,384), qwen3.5-9b, smollm2-135m
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl).
set -u
case "${1:-}" in schedule|split128|probe|dflash|wide|final) ;; *)
    echo "device_long.sh: schedule | split128 | probe | dflash | wide | final"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ab() {  # NAME TIMEOUT CONTEXT ab_flags args...
    local name=$1 t=$2 c=$3; shift 3
    timeout $t python scripts/ab_flags.py --context $c --no-drafters --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^\|" $R/ab_$name.log | cut -c1-150
}
bench() {  # NAME CONTEXT [bench args]: the log's summary lines
    local name=$1 ctx=$2; shift 2
    timeout 200 python -m specdec bench --shape $name --context $ctx --oracle-tau 6.5 --json $R/b_${name}_$ctx.json "$@" \
        > $R/b_${name}_$ctx.log 2>&1
    echo "== $name $ctx rc=$?"; grep -vE "^ *(verify|k=)" $R/b_${name}_$ctx.log | tail -9 | cut -c1-260
}
case "${1:-}" in
schedule)
    timeout 270 python scripts/sweep_split_attention.py --long --json $R/sweep_long.json > $R/sweep_long.log 2>&1
    echo "sweep rc=$?"; grep -E "Error|error" $R/sweep_long.log | head -3
    python - $R/sweep_long.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
cases = [k for k in rows[0] if k not in ("tile", "schedule", "chunk") and not k.endswith(" split")]
print("tile | schedule | chunk | " + " | ".join(cases))
for r in sorted(rows, key=lambda r: sum(r[c] if isinstance(r[c], float) else 1e4 for c in cases)):
    print(r["tile"], r["schedule"], r["chunk"], [r[c] if isinstance(r[c], float) else "err" for c in cases])
PY
    bench qwen3-8b 512 --contexts 4096,16384 --draft-vocab 32768 --reps 10 ;;
split128)
    ab 8b_16k 200 16000 --shape qwen3-8b --rounds 3 --variants defaults defaults-small-tiles defaults+far0
    ab 8b_512 120 512 --shape qwen3-8b --rounds 3 --variants defaults defaults-small-tiles
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen3; do
        d="oracle ngram dflash"; [ $t = qwen3 ] && d="$d mtp"
        for m in graphs eager; do
            timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode $m --drafters $d \
                --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > $R/dc_${t}_$m.log 2>&1 || echo "$t $m rc=$?"
        done
    done
    timeout 150 python scripts/check_split_attention.py --json $R/check_split.json > $R/check_split.log 2>&1
    echo "check_split rc=$?"; grep -E "failures|\"ok\": false" $R/check_split.log | cut -c1-200
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -6 ;;
probe)
    for s in qwen3-8b smollm2-135m; do
        timeout 150 python scripts/profile_engine.py --shape $s --draft oracle -k 15 --prompts 3 -n 128 --rows 30 \
            > $R/prof_engine_$s.log 2>&1; echo "== profile_engine $s rc=$?"; grep -E "^\{" $R/prof_engine_$s.log
    done
    timeout 150 python scripts/check_fused_layer.py --shape qwen3.5-35b-a3b --only delta_out --sweep --rows 1 --no-model \
        --json $R/sweep_out.json > $R/sweep_out.log 2>&1; echo "out sweep rc=$?"; grep -E "delta_out|FAIL|TILES" $R/sweep_out.log | tail -4
    timeout 220 python scripts/sweep_moe_kernel.py --shape qwen3.5-35b-a3b --json $R/sweep_moe.json > $R/sweep_moe.log 2>&1
    echo "moe sweep rc=$?"; grep -E "fused|best|bits" $R/sweep_moe.log | tail -8 ;;
dflash)
    timeout 200 python scripts/profile_shape_step.py --shape qwen3-8b --drafter dflash --rows 16 --context 512 --top 40 \
        > $R/prof_dflash.json 2> $R/prof_dflash.err; echo "profile rc=$?"; tail -3 $R/prof_dflash.err ;;
wide)
    for s in qwen3-8b qwen3.5-9b; do
        timeout 150 python scripts/check_dflash_fast.py --shape $s --json $R/dflash_fast_$s.json > $R/dflash_fast_$s.log 2>&1
        echo "== check_dflash_fast $s rc=$?"; tail -25 $R/dflash_fast_$s.log | tr -d '\n' | cut -c1-900; echo
    done
    bench qwen3-8b 512 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 512 --draft-vocab 32768 --reps 10 ;;
final)
    bench qwen3-8b 512 --contexts 4096,16384 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 512 --draft-vocab 32768 --reps 10
    bench smollm2-135m 512 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
