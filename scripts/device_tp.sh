#!/bin/bash
# Tensor parallelism on the H200 x2 machine (BENCHMARKS.md): random-weight targets of published
# shapes (no checkpoint needed), TP=1 against TP=2, plain decoding and an oracle drafter, with the
# static steps (and their NCCL collectives) captured as CUDA graphs. One device call, < 10 min.
#   bash scripts/device_tp.sh [REPS [SHAPES [EXTRA BENCH ARGS...]]]
#   e.g. bash scripts/device_tp.sh 10 "qwen3-8b" --compile
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=${1:-10}
SHAPES=${2:-"qwen3-8b qwen3.5-35b-a3b"}
shift 2 2>/dev/null || shift $#
EXTRA="$*"
TAG=$(echo "$EXTRA" | tr -d ' -')
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
shape() {  # name, seconds, args...
    local name=$1 secs=$2; shift 2
    timeout "$secs" python -m specdec bench --reps $R -n 128 --json $OUT/$name.json "$@" > /tmp/$name.log 2>&1
    echo "== $name rc=$? ($*)"; grep -vE "it/s|^\s*$|Warning|warn" /tmp/$name.log | tail -9 | cut -c1-400
}
for s in $SHAPES; do
    n=$(echo $s | tr -d '.-')$TAG
    shape tp1_$n 170 --shape $s $EXTRA
    shape tp2_$n 200 --shape $s --tensor-parallel 2 $EXTRA
done
