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
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
W=$OUT/g; mkdir -p $W
S=gemma4-26b-a4b
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
