#!/bin/bash
# Issue 10's shape benches on an H200 (its targets are stated for one; the device gave only H100s from 2026-12-06 to
# 2026-12-06 (sixth)). Exits at once (rc 3) on any other card, so a call that gets an H100 costs only its start.
# Needs the gguf wheel (carry .whl); no checkpoint. Results in $OUT/r.tgz.
#   bash scripts/device_h200.sh a    # qwen3-8b at 512 (-n 512, the oracle at tau 6.5; the DFlash drafter bf16 and int8)
#   bash scripts/device_h200.sh b    # qwen3.5-9b, qwen3.5-35b-a3b, smollm2-135m
#   bash scripts/device_h200.sh c    # qwen3-8b's 4k and 16k steps
#   ANY_GPU=1 bash scripts/device_h200.sh a|b   # on whatever card came
set -u
case "${1:-}" in a|b|c) ;; *) echo "device_h200.sh: a | b | c"; exit 2 ;; esac
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu"
case "$gpu" in *H200*) ;; *) [ "${ANY_GPU:-0}" = 1 ] || { echo "device_h200.sh: not an H200"; exit 3; } ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
bench() {  # NAME TIMEOUT [bench args]: the log's summary lines
    local name=$1 t=$2; shift 2
    timeout $t python -m specdec bench --shape $name --context 512 --oracle-tau 6.5 --json $R/b_$name.json "$@" \
        > $R/b_$name.log 2>&1
    echo "== $name rc=$?"; grep -vE "^ *(verify|k=)" $R/b_$name.log | tail -9 | cut -c1-260
}
case "$1" in
a)
    bench qwen3-8b 300 -n 512 --draft-vocab 32768 --draft-int8 --reps 10 ;;
b)
    bench qwen3.5-9b 180 --draft-vocab 32768 --reps 10
    bench qwen3.5-35b-a3b 250 --draft-vocab 32768 --reps 10
    bench smollm2-135m 120 ;;
c)
    bench qwen3-8b 300 --contexts 4096,16384 --draft-vocab 32768 --reps 10 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
