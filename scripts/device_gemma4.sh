#!/bin/bash
# Gemma 4 on the expert kernels (issue 10: a fast CUDA step for every target family), one device call (carry .whl):
#   bash scripts/device_gemma4.sh
# On the gemma4-26b-a4b shape (random weights, context 512): the padded and 1-row steps with the MoE kernels (the
# defaults: expert_kernel.moe, GELU-tanh experts), with the pairs only (SPECDEC_FUSED_MOE=0: the router in torch ops)
# and with neither (SPECDEC_EXPERT_KERNEL=0: torch's dense form, every expert on every row), and with the attention's
# norms, RoPE and cache write in torch ops (SPECDEC_NORM_ROPE=0), one process (scripts/ab_flags.py); the padded step's kernels (profile_shape_step --timeline);
# device_check on a random Gemma 4 MoE with accepted drafts (oracle, n-gram; graphs and eager); `specdec bench --shape
# gemma4-26b-a4b`. Results in $OUT/g.tgz.
#   bash scripts/device_gemma4.sh again   # (carry .dev/old too: an earlier commit's specdec/ and scripts/) the old
#                                         # tree's step against this one's, device_check Gemma 4 + Qwen3.5 MoE, bench
#   bash scripts/device_gemma4.sh final   # the bench and device_check (graphs) on the final tree
#   bash scripts/device_gemma4.sh tiles   # (after fused) the MoE kernels' tile pairs, SHAPE_TILES on and off in the
#                                         # step, the attention's GEMM tiles swept and tried in the step, device_check
#   bash scripts/device_gemma4.sh fused   # Gemma 4 row-exact on the fused layers (2026-12-07): the split attention's
#                                         # 512-wide heads against SDPA; the fused path on and off (ab_flags:
#                                         # defaults / defaults-fused-layer); device_check Gemma 4 graphs and eager;
#                                         # the bench; the 1-row step's kernels; the MoE kernels' and the GEMMs' tile
#                                         # sweeps (last, as time allows; SWEEP_S seconds at most for the GEMMs')
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
W=$OUT/g; mkdir -p $W
S=gemma4-26b-a4b
left() { echo $(( ${1} < 560 - SECONDS ? ${1} : 560 - SECONDS )); }  # a step's timeout within the call's 600 s
dcheck() {  # MODE...: device_check on a random Gemma 4 MoE (oracle and n-gram drafts) in these modes, then compared
    D=/tmp/dc; rm -rf $D
    timeout $(left 150) python scripts/device_check.py build $D > $W/dc_build.log 2>&1; echo "== build rc=$? ${SECONDS}s"
    for m in "$@"; do
        timeout $(left 120) python scripts/device_check.py run $D --target gemma4 --mode $m --drafters oracle ngram \
            --prompts 4 --new-tokens 128 --out $W/dc_gemma4_$m.json 2>&1 | tail -1 | cut -c1-200
    done
    python scripts/device_check.py compare $W/dc_gemma4_*.json --out $W/dc_report.json 2>&1 | tail -8
    echo "== dc ${SECONDS}s"
}
bench() {  # the shape bench at context 512 (the oracle at tau 6.5)
    timeout $(left 150) python -m specdec bench --shape $S --context 512 --oracle-tau 6.5 --reps 3 -n 128 \
        --json $W/b_gemma4.json > $W/b_gemma4.log 2>&1
    echo "== bench rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_gemma4.log | tail -8 | cut -c1-240
}
if [ "${1:-}" = final ]; then  # the final tree (the GEMM tilings in the table): the bench, device_check graphs
    bench
    dcheck graphs
    cd $OUT && tar czf g.tgz g && rm -rf g
    exit 0
fi
if [ "${1:-}" = tiles ]; then
    # after call 1's sweeps: the MoE kernels' tile pairs at every row count; the step with SHAPE_TILES and without
    # (defaults / defaults+moe-tiles0), the one-kernel tail and not (defaults-tail); the attention's GEMMs swept, their best against the table in the step
    # (defaults+tiles); device_check Gemma 4 graphs and eager on the new tiles; the bench
    timeout $(left 120) python scripts/sweep_moe_kernel.py --shape $S --layers 12 --json $W/moe_combos.json --combos \
        4,1024,4/1,512,1,16 2,2048,2/1,512,1,16 4,1024,4/2,256,8,8 2,2048,2/2,256,8,8 8,256,8/2,256,8,8 \
        2,2048,2/2,256,8,16 8,512,4/2,256,4,8 > $W/moe_combos.log 2>&1
    echo "== moe combos rc=$? ${SECONDS}s"; cut -c1-200 $W/moe_combos.log
    timeout $(left 120) python scripts/ab_flags.py --shape $S --context 512 --rounds 3 --reps 10 --no-drafters \
        --variants defaults defaults+moe-tiles0 defaults-tail --json $W/ab_moe.json > $W/ab_moe.log 2>&1
    echo "== ab moe rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_moe.log | tail -2 | cut -c1-300
    timeout $(left 150) python scripts/check_fused_layer.py --shape $S --sweep --rows 1 --no-model --json $W/sweep2.json \
        --only qkv_256 o_256 qkv_512 o_512 router gate_up+silu down > $W/sweep2.log 2>&1
    echo "== sweep rc=$? ${SECONDS}s"; grep -E "rows, triton|best tiles|FAIL" $W/sweep2.log | cut -c1-200
    T=$(grep -o "SPECDEC_FUSED_LAYER_TILES='.*'" $W/sweep2.log | sed "s/^SPECDEC_FUSED_LAYER_TILES='//; s/'$//")
    if [ -n "$T" ]; then
        AB_TILES="$T" timeout $(left 120) python scripts/ab_flags.py --shape $S --context 512 --rounds 3 --reps 10 \
            --no-drafters --variants defaults defaults+tiles --json $W/ab_tiles.json > $W/ab_tiles.log 2>&1
        echo "== ab tiles rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_tiles.log | tail -2 | cut -c1-300
    fi
    dcheck graphs eager
    bench
    cd $OUT && tar czf g.tgz g && rm -rf g
    exit 0
fi
if [ "${1:-}" = fused ]; then
    timeout $(left 200) python scripts/ab_flags.py --shape $S --context 512 --rounds 3 --reps 10 --no-drafters \
        --variants defaults defaults-fused-layer defaults-prenorm --json $W/ab_fused.json > $W/ab_fused.log 2>&1
    echo "== ab rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_fused.log | tail -3 | cut -c1-300
    dcheck graphs eager
    bench
    timeout $(left 90) python scripts/check_split_attention.py --only gemma4-full --json $W/split512.json \
        > $W/split512.log 2>&1
    echo "== split512 rc=$? ${SECONDS}s"; grep -E "failures|\"t\": 1, \"span\": (256|1024|4096), \"split\"" $W/split512.log | head -5 | cut -c1-200
    timeout $(left 100) python scripts/profile_shape_step.py --shape $S --rows 1 --context 512 --top 22 \
        --timeline $W/tl_gemma4_1row.json > $W/prof_gemma4.log 2>&1
    echo "== profile rc=$? ${SECONDS}s"; grep -vE "^ *$" $W/prof_gemma4.log | head -30 | cut -c1-160
    timeout $(left 150) python scripts/sweep_moe_kernel.py --shape $S --layers 12 --json $W/moe_sweep.json \
        > $W/moe_sweep.log 2>&1
    echo "== moe sweep rc=$? ${SECONDS}s"; grep -E "^best|bits|fused " $W/moe_sweep.log | cut -c1-200
    timeout $(left ${SWEEP_S:-200}) python scripts/check_fused_layer.py --shape $S --sweep --head --rows 1 --no-model \
        --json $W/sweep.json > $W/sweep.log 2>&1
    echo "== sweep rc=$? ${SECONDS}s"; grep -iE "best|FAIL|TILES" $W/sweep.log | tail -12 | cut -c1-300
    cd $OUT && tar czf g.tgz g && rm -rf g
    exit 0
fi
if [ "${1:-}" = again ]; then
    # after the kernel-count changes: the old tree (a copy of an earlier commit's specdec/ and scripts/ in
    # .dev/old, carried) and this one, each in its own process on this machine; device_check on Gemma 4 (graphs
    # and eager: now equal?) and the Qwen3.5 MoE (the static forms' change); the bench
    for tree in old new; do
        P=$PWD; [ $tree = old ] && P=$PWD/.dev/old
        (cd $P && PYTHONPATH=/tmp/site:$P:$P/tests timeout 150 python scripts/ab_flags.py --shape $S --context 512 \
            --rounds 3 --reps 10 --no-drafters --variants defaults defaults-prenorm --json $W/ab_$tree.json \
            > $W/ab_$tree.log 2>&1); echo "== ab $tree rc=$?"; grep -v "^round" $W/ab_$tree.log | tail -2
    done
    D=/tmp/dc; rm -rf $D
    timeout 200 python scripts/device_check.py build $D > $W/dc_build.log 2>&1; echo "== build rc=$?"
    for t in gemma4 qwen35moe; do
        for m in graphs eager; do
            timeout 150 python scripts/device_check.py run $D --target $t --mode $m --drafters oracle ngram \
                --prompts 4 --new-tokens 128 --out $W/dc_${t}_$m.json 2>&1 | tail -1 | cut -c1-200
        done
    done
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -14
    timeout 200 python -m specdec bench --shape $S --context 512 --oracle-tau 6.5 --reps 3 -n 128 \
        --json $W/b_gemma4.json > $W/b_gemma4.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $W/b_gemma4.log | tail -8 | cut -c1-240
    cd $OUT && tar czf g.tgz g && rm -rf g
    exit 0
fi
D=/tmp/dc; rm -rf $D
timeout 200 python scripts/device_check.py build $D > $W/dc_build.log 2>&1; echo "== build rc=$?"
for m in graphs eager; do
    timeout 150 python scripts/device_check.py run $D --target gemma4 --mode $m --drafters oracle ngram \
        --prompts 4 --new-tokens 128 --out $W/dc_gemma4_$m.json 2>&1 | tail -1 | cut -c1-200
done
python scripts/device_check.py compare $W/dc_gemma4_*.json --out $W/dc_report.json 2>&1 | tail -8
timeout 240 python scripts/ab_flags.py --shape $S --context 512 --rounds 3 --reps 10 --no-drafters \
    --variants defaults defaults-fused-moe defaults-expert-kernel defaults-norm-rope --json $W/ab_gemma4.json > $W/ab_gemma4.log 2>&1
echo "== ab rc=$?"; grep -v "^round" $W/ab_gemma4.log | tail -4
timeout 150 python scripts/profile_shape_step.py --shape $S --rows 1 --pad-to 16 --context 512 --top 22 \
    --timeline $W/tl_gemma4.json > $W/prof_gemma4.log 2>&1
echo "== profile rc=$?"; grep -vE "^ *$" $W/prof_gemma4.log | head -45 | cut -c1-200
timeout 200 python -m specdec bench --shape $S --context 512 --oracle-tau 6.5 --reps 3 -n 128 \
    --json $W/b_gemma4.json > $W/b_gemma4.log 2>&1
echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $W/b_gemma4.log | tail -8 | cut -c1-240
cd $OUT && tar czf g.tgz g && rm -rf g
