#!/bin/bash
# Issue 10's shapes on one tree, and Gemma 4's small models (E2B, E4B: KV sharing, per-layer inputs) on the fused
# layers; one device call each (carry .whl):
#   bash scripts/device_e2b.sh shapes   # specdec bench --shape for qwen3.5-35b-a3b, qwen3-8b (512, then 4,096 and
#                                       # 16,384; the DFlash drafter on int8 weights too), qwen3.5-9b, smollm2-135m,
#                                       # gemma4-26b-a4b, gemma4-e2b and gemma4-e4b, as the call's time allows
#   bash scripts/device_e2b.sh fused    # the gemma4-e2b shape: device_check on a random small Gemma 4 (graphs and
#                                       # eager, oracle and n-gram drafts) with SPECDEC_GEMMA4_SMALL_FUSED=1; its fused
#                                       # path on and off in one process (ab_flags defaults / defaults+small-fused); its
#                                       # bench and its 1-row step's kernels (fused), as time allows
#   bash scripts/device_e2b.sh tiles    # the gemma4-e2b shape's fused GEMMs swept at 1 row (check_fused_layer.py), the
#                                       # 1-row step with the sweep's best tilings (ab_flags defaults / +small-fused /
#                                       # +small-fused+tiles / the same without the dense tail kernels)
#   bash scripts/device_e2b.sh e4b      # the gemma4-e4b shape: ab_flags (cuBLAS padded / fused / no dense tail), its
#                                       # bench, its GEMMs swept
# (fused and tiles ran before SPECDEC_GEMMA4_SMALL_FUSED was on by default and the E2B's tilings in the table, as
# defaults / defaults+small-fused(+tiles) variants; the variants here are today's names. A mode `narrow` timed
# fused_layer.NARROW_SPLIT against the defaults in the session of 2026-12-07 (fifteenth): no gain, removed with it.)
# Results in $OUT/e.tgz.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
W=$OUT/e; mkdir -p $W
left() { echo $(( ${1} < 570 - SECONDS ? ${1} : 570 - SECONDS )); }  # a step's timeout within the call's 600 s
bench() {  # NAME CONTEXT TIMEOUT [bench args]: the shape bench (the oracle at tau 6.5), its log's summary lines
    local name=$1 ctx=$2 t=$3; shift 3
    [ "$(left $t)" -lt 30 ] && { echo "== $name $ctx skipped (${SECONDS}s)"; return; }
    timeout $(left $t) python -m specdec bench --shape $name --context $ctx --oracle-tau 6.5 \
        --json $W/b_${name}_$ctx.json "$@" > $W/b_${name}_$ctx.log 2>&1
    echo "== $name $ctx rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_${name}_$ctx.log | tail -9 | cut -c1-240
}
dcheck() {  # TARGET MODE...: device_check with accepted drafts (oracle, n-gram), then the outputs compared
    local target=$1; shift
    D=/tmp/dc; [ -d $D ] || timeout $(left 150) python -c "import os, device_check as d
from transformers import Gemma4ForCausalLM as M, Gemma4TextConfig as C
os.makedirs('$D'); d._build_gemma4('$D', M, C, 1024)" > $W/dc_build.log 2>&1  # the Gemma 4 targets alone
    for m in "$@"; do
        timeout $(left 120) python scripts/device_check.py run $D --target $target --mode $m --drafters oracle ngram \
            --prompts 4 --new-tokens 128 --out $W/dc_${target}_$m.json 2>&1 | tail -1 | cut -c1-200
    done
    python scripts/device_check.py compare $W/dc_${target}_*.json --out $W/dc_${target}.json 2>&1 | tail -6
    echo "== dc $target ${SECONDS}s"
}
save() { (cd $OUT && tar czf e.tgz e); }
case "${1:-}" in
shapes)
    bench qwen3.5-35b-a3b 512 150 --draft-vocab 32768 --reps 10
    bench qwen3-8b 512 170 --contexts 4096,16384 --draft-vocab 32768 --draft-int8 --reps 10
    bench qwen3.5-9b 512 120 --draft-vocab 32768 --reps 10
    bench smollm2-135m 512 60
    bench gemma4-26b-a4b 512 100 --reps 3 -n 128
    bench gemma4-e2b 512 90 --reps 3 -n 128
    bench gemma4-e4b 512 90 --reps 3 -n 128 ;;
fused)  # (each step's files packed as it ends: a call cut short by the device time left still returns them)
    SPECDEC_GEMMA4_SMALL_FUSED=1 dcheck gemma4e graphs eager; save
    timeout $(left 200) python scripts/ab_flags.py --shape gemma4-e2b --context 512 --rounds 3 --reps 10 --no-drafters \
        --variants defaults-small-fused defaults --json $W/ab_e2b.json > $W/ab_e2b.log 2>&1
    echo "== ab rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_e2b.log | tail -3 | cut -c1-300; save
    SPECDEC_GEMMA4_SMALL_FUSED=1 bench gemma4-e2b 512 100 --reps 3 -n 128; save
    [ "$(left 100)" -gt 60 ] && { SPECDEC_GEMMA4_SMALL_FUSED=1 timeout $(left 100) python scripts/profile_shape_step.py --shape gemma4-e2b --rows 1 \
        --context 512 --top 22 --timeline $W/tl_e2b_1row.json > $W/prof_e2b.log 2>&1
        echo "== profile rc=$? ${SECONDS}s"; grep -vE "^ *$" $W/prof_e2b.log | head -30 | cut -c1-160; } ;;
tiles)  # the E2B's fused GEMMs swept at 1 row: first its narrow 1,536-output projections (K split too), then the 1-row
    # step with their best tilings against the defaults and the switch on with the table's, and without the dense tail
    # kernels (fused_ops.DENSE_TAIL; one process); device_check on the random small Gemma 4; the others swept; the bench
    # with the narrow projections' best tilings
    sweep() {  # NAME WEIGHT...: check_fused_layer's sweep of these weights; its best tilings in $T
        local n=$1; shift
        timeout $(left 200) python scripts/check_fused_layer.py --shape gemma4-e2b --sweep --rows 1 --no-model \
            --json $W/sweep_$n.json --only "$@" > $W/sweep_$n.log 2>&1
        echo "== sweep $n rc=$? ${SECONDS}s"; grep -E "rows, triton|best tiles|FAIL" $W/sweep_$n.log | cut -c1-220; save
        T=$(grep -o "SPECDEC_FUSED_LAYER_TILES='.*'" $W/sweep_$n.log | sed "s/^SPECDEC_FUSED_LAYER_TILES='//; s/'$//")
    }
    sweep narrow o_256 o_512 down down_1536x12288 per_layer_proj
    [ -n "$T" ] && { AB_TILES="$T" timeout $(left 200) python scripts/ab_flags.py --shape gemma4-e2b --context 512 \
        --rounds 3 --reps 10 --no-drafters --variants defaults-small-fused defaults defaults+tiles defaults-dense-tail \
        --json $W/ab_tiles.json > $W/ab_tiles.log 2>&1
    echo "== ab tiles rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_tiles.log | tail -6 | cut -c1-300; save; }
    SPECDEC_GEMMA4_SMALL_FUSED=1 dcheck gemma4e graphs eager; save  # (the dense tail kernels on accepted drafts)
    NT="$T"; sweep rest qkv_256 qkv_512 q_shared_256 q_shared_512 per_layer_gate gate_up+silu gate_up+silu_24576x1536 \
        per_layer_model
    [ -n "$NT" ] && SPECDEC_GEMMA4_SMALL_FUSED=1 SPECDEC_FUSED_LAYER_TILES="$NT" bench gemma4-e2b 512 100 --reps 3 -n 128 ;;
e4b)  # the gemma4-e4b shape: its step on cuBLAS padded, on the fused layers, and without the dense tail kernels (one
    # process); its bench; its fused GEMMs swept at 1 row, as time allows
    timeout $(left 200) python scripts/ab_flags.py --shape gemma4-e4b --context 512 --rounds 3 --reps 10 --no-drafters \
        --variants defaults-small-fused defaults defaults-dense-tail --json $W/ab_e4b.json > $W/ab_e4b.log 2>&1
    echo "== ab e4b rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_e4b.log | tail -5 | cut -c1-300; save
    bench gemma4-e4b 512 120 --reps 3 -n 128; save
    timeout $(left 200) python scripts/check_fused_layer.py --shape gemma4-e4b --sweep --rows 1 --no-model \
        --json $W/sweep_e4b.json --only o_256 o_512 down \
        per_layer_gate per_layer_proj qkv_256 qkv_512 q_shared_256 q_shared_512 gate_up+silu per_layer_model \
        > $W/sweep_e4b.log 2>&1
    echo "== sweep e4b rc=$? ${SECONDS}s"; grep -E "rows, triton|best tiles|FAIL" $W/sweep_e4b.log | cut -c1-220 ;;
*)
    echo "usage: bash scripts/device_e2b.sh shapes | fused | tiles | e4b"; exit 2 ;;
esac
save && rm -rf $W
