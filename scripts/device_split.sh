#!/bin/bash
# Issue 10, session of 2026-12-06 (fifth): the first split's size for heads of 128 (split_attention.split_keys) under
# the far-split schedule, on the qwen3-8b shape.
# Call 3 ran `ab` at 36e810c (256-key first splits then): ab_flags defaults / +split128 / +split128+far2048 at contexts
# 512, 4,000 and 16,000 (1-row and padded steps); bench --shape qwen3-8b (512, 4,096, 16,384) with SPECDEC_SPLIT_KEYS=128.
#   bash scripts/device_split.sh tiers  # the three tiers shipped (128 / 256 / 512 keys): ab_flags defaults /
#                                       # defaults+split256 (the schedule before) at 512, 4,000, 16,000; check_split_attention
#                                       # (a row's bits at a doubled span, alone, in a batch of one); device_check on random
#                                       # Llama and Qwen3 (graphs; oracle, n-gram, DFlash, MTP drafts)
#   bash scripts/device_split.sh final  # bench --shape qwen3-8b (512, 4,096, 16,384) with them
#   bash scripts/device_split.sh probe  # ab_flags defaults / +split128 on smollm2-135m at 300 (its heads of 64); bench
#                                       # --shape qwen3-8b -n 512 (the oracle over more steps: its realized tau nearer 6.5)
#   bash scripts/device_split.sh mtp    # profile_engine --shape smollm2-135m: the engine's split of a step with a random
#                                       # MTP head (k 3), a random DFlash drafter (k 15) and none (where MTP's propose goes)
#   bash scripts/device_split.sh mtpreal  # after device_stage.sh part1 and join: profile_engine on the real SmolLM2 GGUF
#                                         # with its shipped MTP head (k 3), the tree with the shipped drafters
#   (call 6's `early` case, the MoE combine's weights loaded before its wait with check_moe_early.py, is at 442c10c:
#   measured slower, removed)
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl).
set -u
case "${1:-}" in ab|tiers|final|probe|mtp|mtpreal) ;; *) echo "device_split.sh: ab | tiers | final | probe | mtp | mtpreal"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ab() {  # NAME TIMEOUT CONTEXT ab_flags args...
    local name=$1 t=$2 c=$3; shift 3
    timeout $t python scripts/ab_flags.py --context $c --no-drafters --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^\||Error" $R/ab_$name.log | cut -c1-150
}
case "$1" in
ab)
    v="defaults defaults+split128 defaults+split128+far2048"
    ab 8b_512 120 512 --shape qwen3-8b --rounds 3 --variants $v
    ab 8b_4k 120 4000 --shape qwen3-8b --rounds 3 --variants $v
    ab 8b_16k 150 16000 --shape qwen3-8b --rounds 3 --variants $v
    SPECDEC_SPLIT_KEYS=128 timeout 200 python -m specdec bench --shape qwen3-8b --context 512 --contexts 4096,16384 \
        --oracle-tau 6.5 --draft-vocab 32768 --reps 10 --json $R/b8b_split128.json > $R/b8b_split128.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b8b_split128.log | tail -9 | cut -c1-260 ;;
tiers)
    v="defaults defaults+split256"
    ab 8b_512 100 512 --shape qwen3-8b --rounds 3 --variants $v
    ab 8b_4k 100 4000 --shape qwen3-8b --rounds 3 --variants $v
    ab 8b_16k 120 16000 --shape qwen3-8b --rounds 3 --variants $v
    timeout 140 python scripts/check_split_attention.py --json $R/check_split.json > $R/check_split.log 2>&1
    echo "check_split rc=$?"; grep -E "failures|\"ok\": false" $R/check_split.log | cut -c1-200
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen3; do
        d="oracle ngram dflash"; [ $t = qwen3 ] && d="$d mtp"
        timeout 50 python scripts/device_check.py run /tmp/dc --target $t --mode graphs --drafters $d \
            --prompts 4 --new-tokens 128 --out $R/dc_${t}_graphs.json > $R/dc_${t}_graphs.log 2>&1 || echo "$t rc=$?"
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -4 ;;
final)
    timeout 200 python -m specdec bench --shape qwen3-8b --context 512 --contexts 4096,16384 --oracle-tau 6.5 \
        --draft-vocab 32768 --reps 10 --json $R/b8b_tiers.json > $R/b8b_tiers.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b8b_tiers.log | tail -9 | cut -c1-260 ;;
probe)
    ab smollm2_300 100 300 --shape smollm2-135m --rounds 5 --variants defaults defaults+split128
    timeout 300 python -m specdec bench --shape qwen3-8b --context 512 -n 512 --oracle-tau 6.5 --draft-vocab 32768 \
        --reps 5 --json $R/b8b_n512.json > $R/b8b_n512.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b8b_n512.log | tail -4 | cut -c1-260 ;;
mtp)
    for d in mtp dflash none; do
        k=3; [ $d = dflash ] && k=15; [ $d = none ] && k=0
        timeout 100 python scripts/profile_engine.py --shape smollm2-135m --draft $d -k $k --prompts 4 -n 128 --rows 30 \
            > $R/prof_engine_$d.log 2>&1; echo "== $d rc=$?"; grep -E "^\{|step" $R/prof_engine_$d.log | head -4 | cut -c1-400
    done ;;
mtpreal)
    [ -s /tmp/smol.gguf ] || { echo "device_split.sh mtpreal: no /tmp/smol.gguf (run device_stage.sh part1 and join)"; exit 2; }
    timeout 150 python scripts/profile_engine.py --model /tmp/smol.gguf --draft mtp -k 3 --prompts 6 -n 128 --rows 40 \
        > $R/prof_engine_real_mtp.log 2>&1; echo "== real mtp rc=$?"; grep -E "^\{" $R/prof_engine_real_mtp.log | cut -c1-400 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
