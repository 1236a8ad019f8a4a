#!/bin/bash
# Issue 10, session of 2026-12-06 (fifth): the L2 look-ahead (models/pdl.py, SPECDEC_L2_AHEAD: a later GEMM's weights
# pulled into L2 while the small kernels before it run). Call 1 ran `ab` with the bulk form (14f39e3).
#   bash scripts/device_ahead.sh ab     # ab_flags defaults / +ahead-out / +ahead-down / +ahead-all (+last) on
#                                       # qwen3.5-35b-a3b, defaults / +ahead-out (+last) on qwen3-8b (1-row and padded steps at 512); the 35b's
#                                       # timeline with SPECDEC_L2_AHEAD=all (profile_shape_step.py --timeline)
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl).
set -u
case "${1:-}" in ab) ;; *) echo "device_ahead.sh: ab"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ab() {  # NAME TIMEOUT ab_flags args...
    local name=$1 t=$2; shift 2
    timeout $t python scripts/ab_flags.py --context 512 --no-drafters --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^\||Error" $R/ab_$name.log | cut -c1-150
}
case "$1" in
ab)
    ab 35b 300 --shape qwen3.5-35b-a3b --rounds 3 --variants defaults defaults+ahead-out defaults+ahead-down \
        defaults+ahead-all defaults+ahead-all+last
    ab 8b 150 --shape qwen3-8b --rounds 3 --variants defaults defaults+ahead-out defaults+ahead-out+last
    SPECDEC_L2_AHEAD=all timeout 120 python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --context 512 --rows 1 \
        --timeline $R/timeline35b_all.json > $R/prof35b_all.json 2> $R/prof35b_all.err; echo "profile rc=$?"
    tail -3 $R/prof35b_all.err ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
