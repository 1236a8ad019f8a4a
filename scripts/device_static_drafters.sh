#!/bin/bash
# One H200 call (< 10 min) to measure the two static drafter steps built off (2026-12-02, BENCHMARKS.md):
# SPECDEC_DFLASH_STATIC_FLUSH=1 (DFlash's context write captured) and SPECDEC_MTP_STATIC_SAMPLING=1
# (sampled MTP proposals captured), each against the default in its own bench process.
#   bash scripts/device_static_drafters.sh /tmp/smollm2.gguf        # results: $OUT/all.tar
# Then flip the defaults in specdec/drafters/dflash.py and mtp.py if the checks hold and the steps pay.
set -u
M=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
# exactness with both on: random targets, accepted drafts (spoiled oracle), DFlash and MTP, graphs
D=/tmp/dc; timeout 120 python scripts/device_check.py build $D > $OUT/dc_build.log 2>&1
for t in llama qwen35; do
  dr="oracle mtp dflash"; [ $t = llama ] && dr="oracle dflash"
  SPECDEC_DFLASH_STATIC_FLUSH=1 SPECDEC_MTP_STATIC_SAMPLING=1 timeout 300 python scripts/device_check.py run $D \
    --target $t --mode graphs --drafters $dr --out $OUT/dc_$t.json > $OUT/dc_$t.log 2>&1 &
done
wait
python scripts/device_check.py compare $OUT/dc_*.json 2>&1 | tail -12
b() { name=$1; shift; timeout 150 python -m specdec bench -m $M -n 128 --dataset gsm8k --num-prompts 60 \
        --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$?"; grep "^|" $OUT/$name.log | tail -4; }
b dflash_eager_flush --drafts none dflash
SPECDEC_DFLASH_STATIC_FLUSH=1 b dflash_static_flush --drafts none dflash
b mtp_t1_eager -t 1 --drafts none mtp -k 3
SPECDEC_MTP_STATIC_SAMPLING=1 b mtp_t1_static -t 1 --drafts none mtp -k 3
cd $OUT && tar cf all.tar *.json *.log && rm -f *.json *.log
