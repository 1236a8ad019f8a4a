#!/bin/bash
# One H200 call (< 10 min): the two static drafter steps (DFlash's context write captured, sampled MTP
# proposals captured; on by default since 2026-12-02, BENCHMARKS.md) checked for exactness and each timed
# against its eager form (SPECDEC_DFLASH_STATIC_FLUSH=0 / SPECDEC_MTP_STATIC_SAMPLING=0) in its own process.
#   bash scripts/device_static_drafters.sh /tmp/smollm2.gguf        # results: $OUT/all.tar
set -u
M=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
# exactness with both on (the defaults): random targets, accepted drafts (spoiled oracle), DFlash and MTP, graphs
D=/tmp/dc; timeout 120 python scripts/device_check.py build $D > $OUT/dc_build.log 2>&1
for t in llama qwen35; do
  dr="oracle mtp dflash"; [ $t = llama ] && dr="oracle dflash"
  timeout 300 python scripts/device_check.py run $D \
    --target $t --mode graphs --drafters $dr --out $OUT/dc_$t.json > $OUT/dc_$t.log 2>&1 &
done
wait
python scripts/device_check.py compare $OUT/dc_*.json 2>&1 | tail -12
b() { name=$1; shift; timeout 150 python -m specdec bench -m $M -n 128 --dataset gsm8k --num-prompts 60 \
        --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$?"; grep "^|" $OUT/$name.log | tail -4; }
SPECDEC_DFLASH_STATIC_FLUSH=0 b dflash_eager_flush --drafts none dflash
b dflash_static_flush --drafts none dflash
SPECDEC_MTP_STATIC_SAMPLING=0 b mtp_t1_eager -t 1 --drafts none mtp -k 3
b mtp_t1_static -t 1 --drafts none mtp -k 3
cd $OUT && tar cf all.tar *.json *.log && rm -f *.json *.log
