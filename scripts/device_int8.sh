#!/bin/bash
# The int8 DFlash drafter (--draft-int8, fused_layer.Int8Rows) on the GPU, in one device call (< 10 min; carry .whl):
# its fast blocks against an eager copy on the int8 values and its propose time (check_dflash_fast.py --int8), its
# GEMMs against bf16 on the fused kernel (check_fused_layer.py --int8), and the shape benches with the int8 drafter
# timed beside the bf16 one. On an H200 the qwen3-8b bench runs issue 10's oracle over 512 tokens too.
#   [GEMMS=1] bash scripts/device_int8.sh        # results in $OUT/r.tgz
set -u
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu"
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
timeout 170 python scripts/check_dflash_fast.py --shape qwen3-8b --int8 -n 64 --json $R/dflash_fast_int8.json \
    > $R/dflash_fast_int8.log 2>&1
echo "== check_dflash_fast rc=$?"; tail -30 $R/dflash_fast_int8.log | cut -c1-200
if [ "${GEMMS:-0}" = 1 ]; then  # the GEMMs alone, int8 against bf16, every int8 tiling of INT8_SWEEP (~40 s)
    timeout 120 python scripts/check_fused_layer.py --shape qwen3-8b --int8 --sweep --no-model --only qkv o \
        gate_up+silu down dflash_fc dflash_kv --json $R/gemm_int8.json > $R/gemm_int8.log 2>&1
    echo "== check_fused_layer rc=$?"; grep -v "^ok" $R/gemm_int8.log | cut -c1-300
fi
bench() {  # NAME TIMEOUT [bench args]: the log's summary lines
    local name=$1 t=$2; shift 2
    timeout $t python -m specdec bench --shape $name --context 512 --oracle-tau 6.5 --json $R/b_$name.json "$@" \
        > $R/b_$name.log 2>&1
    echo "== $name rc=$?"; grep -vE "^ *(verify|k=)" $R/b_$name.log | tail -12 | cut -c1-260
}
case "$gpu" in
*H200*) bench qwen3-8b 280 -n 512 --draft-vocab 32768 --draft-int8 --reps 10 ;;
*) bench qwen3-8b 200 --draft-vocab 32768 --draft-int8 --reps 10
   bench smollm2-135m 70 --draft-int8 --reps 10 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
