#!/bin/bash
# The Qwen3.5 hybrid shapes' steps (issue 10) on the device machine (H200), in one call (carry .whl):
#   bash scripts/device_hybrid.sh            # the steps, kernels on against off; device_check
#   bash scripts/device_hybrid.sh ab FLAG    # scripts/ab_flags.py defaults against defaults-FLAG on both
#                                            # shapes (one process each), device_check, bench qwen3.5-9b
#   bash scripts/device_hybrid.sh vocab N M  # specdec bench --shape on both shapes with --draft-vocab N, and on
#                                            # smollm2-135m with --draft-vocab M
# What the session of 2026-12-03 (seventh) measured, again, at the tree sent: the qwen3.5-9b and
# qwen3.5-35b-a3b shapes (specdec bench --shape, context 512) with the defaults and with the step kernels
# off (SPECDEC_DELTA_FUSED=0 SPECDEC_EXPERT_KERNEL=0), alternated; device_check on random Qwen3.5 dense and
# MoE targets (graphs and eager; oracle, MTP, DFlash, n-gram drafts). The batched serving steps (which run
# the recurrence kernel's other form since 4ffb2f3) are not covered here. Every JSON comes back in one
# hybrid.tgz (the machine returns at most 8 files).
set -u
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
W=/tmp/hybrid
rm -rf $W && mkdir -p $W $OUT
off="SPECDEC_DELTA_FUSED=0 SPECDEC_EXPERT_KERNEL=0"
check() {  # device_check on the random hybrid targets: graphs and eager, then the comparison
    python scripts/device_check.py build $W/dc > /dev/null 2>&1
    for t in qwen35 qwen35moe; do
        for m in graphs eager; do
            python scripts/device_check.py run $W/dc --target $t --mode $m --drafters oracle mtp dflash ngram \
                --prompts 4 --new-tokens 128 --out $W/dc_${t}_$m.json 2>&1 | tail -1
        done
    done
    python scripts/device_check.py compare $W/dc_*.json
}
if [ "${1:-}" = vocab ]; then
    python -m specdec bench --shape qwen3.5-9b --context 512 --draft-vocab $2 --json $W/q35_9b_vocab$2.json 2>&1 \
        | grep -E "decode step|drafter|plain decoding's step|after the"
    timeout 300 python -m specdec bench --shape qwen3.5-35b-a3b --context 512 --reps 5 --draft-vocab $2 \
        --json $W/q35_35b_vocab$2.json 2>&1 | grep -E "decode step|drafter|plain decoding's step|after the"
    python -m specdec bench --shape smollm2-135m --context 300 --draft-vocab $3 --json $W/smollm2_vocab$3.json 2>&1 \
        | grep -E "decode step|drafter|plain decoding's step|after the"
    (cd $W && tar czf $OUT/hybrid.tgz *.json)
    exit 0
fi
if [ "${1:-}" = ab ]; then
    python scripts/ab_flags.py --shape qwen3.5-9b --context 512 --rounds 5 --no-drafters \
        --variants defaults defaults-$2 --json $W/ab_q35_9b_$2.json 2>&1 | grep -v "^round"
    timeout 240 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults-$2 --json $W/ab_q35_35b_$2.json 2>&1 | grep -v "^round"
    python -m specdec bench --shape qwen3.5-9b --context 512 --json $W/q35_9b.json 2>&1 \
        | grep -E "decode step|plain decoding's step|after the"
    check
    (cd $W && tar czf $OUT/hybrid.tgz *.json)
    exit 0
fi
for round in a b; do
    for v in on off; do
        env $([ $v = off ] && echo $off) python -m specdec bench --shape qwen3.5-9b --context 512 \
            --json $W/q35_9b_${v}_$round.json 2>&1 | grep -E "decode step|plain decoding's step|after the"
    done
done
for v in on off; do
    env $([ $v = off ] && echo $off) timeout 220 python -m specdec bench --shape qwen3.5-35b-a3b --context 512 \
        --reps 5 --json $W/q35_35b_$v.json 2>&1 | grep -E "decode step|plain decoding's step|after the"
done
check
(cd $W && tar czf $OUT/hybrid.tgz *.json)
