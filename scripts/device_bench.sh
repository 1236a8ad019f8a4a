#!/bin/bash
# The H200 benchmark of the shipped SmolLM2 drafters (BENCHMARKS.md), in one device call of < 10 min.
# Before it, two calls bring the 98 MB target in halves (the shipped drafters, 46 MiB, moved out
# of the tree for those two, as the tree plus one half must stay under 64 MiB):
#   call 1 (carry .dev/a .whl):  bash scripts/device_train.sh part1
#   call 2 (carry .dev/b/part2): cat /tmp/part1 .dev/b/part2 > /tmp/smollm2.gguf
#   call 3 (whole tree):         SPECDEC_COMMIT=<hash> [CHECK=0] bash scripts/device_bench.sh N_GSM8K N_OTHER
# (N_OTHER=0: GSM8K only; CHECK=0 skips the compile-capture check)
# Every bench row compares its outputs with plain decoding's in the same run (identical / differ).
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/smollm2.gguf
N=${1:-100}   # GSM8K test prompts (the shipped set holds 100)
M=${2:-40}    # HumanEval / MT-Bench prompts
D=specdec/data/drafters/smollm2_135m_instruct/dflash
bench() {  # name, seconds, args...
    local name=$1 secs=$2; shift 2
    timeout "$secs" python -m specdec bench -m $G -n 128 --json $OUT/$name.json "$@" > /tmp/$name.log 2>&1
    echo "== $name rc=$? ($*)"; grep -E "^\||^machine|rror" /tmp/$name.log | tail -16
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# first: does the compiled step give the same bits whatever it captures? (0 differing steps)
[ "${CHECK:-1}" = 1 ] && timeout 120 python scripts/check_compile_capture.py --model $G --dflash $D --prompts 10 -n 128 2>&1 \
    | grep "^{" | tee $OUT/compile_capture.json
bench compile_gsm8k 170 --dataset gsm8k --num-prompts $N --drafts none ngram dflash --compile
[ "$M" -gt 0 ] || exit 0
bench compile_humaneval 90 --dataset humaneval --num-prompts $M --drafts none ngram dflash --compile
bench compile_mt_bench 90 --dataset mt_bench --num-prompts $M --max-turns 1 --drafts none ngram dflash --compile
bench compile_t1_gsm8k 80 --dataset gsm8k --num-prompts 30 -t 1 --drafts none dflash ngram --compile
