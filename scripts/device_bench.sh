#!/bin/bash
# The H200 benchmark of the shipped SmolLM2 drafters (BENCHMARKS.md), in one device call of < 10 min.
# Before it, two calls bring the 98 MB target in halves (the shipped drafters, 46 MiB, moved out
# of the tree for those two, as the tree plus one half must stay under 64 MiB):
#   call 1 (carry .dev/a .whl):  bash scripts/device_train.sh part1
#   call 2 (carry .dev/b/part2): cat /tmp/part1 .dev/b/part2 > /tmp/smollm2.gguf
#   call 3 (whole tree):         SPECDEC_COMMIT=<hash> bash scripts/device_bench.sh N_PROMPTS
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/smollm2.gguf
N=${1:-15}
bench() {  # name, seconds, args...
    local name=$1 secs=$2; shift 2
    timeout "$secs" python -m specdec bench -m $G -n 128 --json $OUT/$name.json "$@" > /tmp/$name.log 2>&1
    echo "== $name rc=$? ($*)"; grep -E "^\||^machine|rror" /tmp/$name.log | tail -16
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
sweep="--drafts none ngram dflash mtp -k 1 2 3 4 --block-size 16 8"
# first: does the compiled step give the same bits whatever it captures? (0 differing: --compile may take DFlash)
timeout 150 python scripts/check_compile_capture.py --model $G --dflash specdec/data/drafters/smollm2_135m_instruct/dflash \
    --prompts $N -n 128 2>&1 | grep "^{" | tee $OUT/compile_capture.json
bench t0_gsm8k 95 --dataset gsm8k --num-prompts $N $sweep
bench compile_gsm8k 140 --dataset gsm8k --num-prompts $N --drafts none ngram dflash --compile
bench t0_humaneval 90 --dataset humaneval --num-prompts $N $sweep
bench t0_mt_bench 90 --dataset mt_bench --num-prompts $N --max-turns 1 $sweep
bench t1_gsm8k 45 --dataset gsm8k --num-prompts $N -t 1 --drafts none ngram dflash mtp -k 3
timeout 100 python scripts/profile_compile.py --model $G --device cuda \
    --dflash specdec/data/drafters/smollm2_135m_instruct/dflash --json $OUT/profile_compile.json 2>&1 | grep -v "it/s" | tail -20
