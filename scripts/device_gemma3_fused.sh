#!/bin/bash
# Gemma 3 on the fused layers (issue 10: a fast CUDA step for every target family), one device call (carry .whl):
#   bash scripts/device_gemma3_fused.sh
# On the gemma3-270m shape (random weights, context 512): the 1-row and padded steps with the fused layers on
# (the defaults), off (SPECDEC_FUSED_LAYER=0: cuBLAS and torch ops, steps padded to 16 rows) and with the static
# steps' RoPE tables off (SPECDEC_ROPE_TABLE=0), one process (scripts/ab_flags.py); `specdec bench --shape
# gemma3-270m` with the fused layers on and off; the fused GEMM on the shape's weights (values, a row's bits,
# tilings at 1 row); device_check on a random Gemma 3 (window 64) with accepted drafts.
#   bash scripts/device_gemma3_fused.sh final   # device_check (Gemma 3); the post-norm + add + norm kernel's
#                                               # bits and time (ab_flags defaults-prenorm); the bench on and off
# Results in $OUT/g.tgz.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1
W=$OUT/g; mkdir -p $W
if [ "${1:-}" = final ]; then
    D=/tmp/dc; rm -rf $D
    timeout 120 python scripts/device_check.py build $D > $W/dc_build.log 2>&1; echo "== build rc=$?"
    for t in gemma3; do
        for m in graphs eager; do
            timeout 150 python scripts/device_check.py run $D --target $t --mode $m --drafters oracle ngram \
                --prompts 4 --new-tokens 128 --out $W/dc_${t}_$m.json 2>&1 | tail -1 | cut -c1-200
        done
    done
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -9
    python - <<'PY' 2>&1 | tail -2  # fused_ops.PRENORM_ADD's one kernel against its two: the same logits
import torch
from specdec.models import fused_ops
from specdec.shapes import build_shape
m = build_shape("gemma3-270m", torch.device("cuda"), torch.bfloat16)
ids = torch.randint(0, 262144, (37,), generator=torch.Generator().manual_seed(0)).cuda()
outs = []
for on in (True, False):
    fused_ops.PRENORM_ADD = on
    cache = m.new_cache(64)
    outs.append(torch.cat([m(ids, cache).logits, m(ids[:1], cache).logits]))
print("prenorm: logits of 37 + 1 rows equal with it on and off:", torch.equal(*outs), "argmax", outs[0].argmax(-1)[:4].tolist())
PY
    timeout 150 python scripts/ab_flags.py --shape gemma3-270m --context 512 --rounds 5 --no-drafters \
        --variants defaults defaults-prenorm --json $W/ab_prenorm.json 2>&1 | grep -v "^round" | tail -4
    for v in on off; do
        env $([ $v = off ] && echo SPECDEC_FUSED_LAYER=0) timeout 100 python -m specdec bench --shape gemma3-270m \
            --context 512 --oracle-tau 6.5 --reps 10 --json $W/b_gemma3_${v}_$RANDOM.json 2>&1 \
            | grep -E "plain decoding's step|after the" | cut -c1-200
    done
    cd $OUT && tar czf g.tgz g && rm -rf g
    exit 0
fi
timeout 200 python scripts/ab_flags.py --shape gemma3-270m --context 512 --rounds 5 --no-drafters \
    --variants defaults defaults-fused-layer defaults-rope-table --json $W/ab_gemma3.json > $W/ab_gemma3.log 2>&1
echo "== ab rc=$?"; grep -v "^round" $W/ab_gemma3.log | tail -5
for v in on off; do
    env $([ $v = off ] && echo SPECDEC_FUSED_LAYER=0) timeout 120 python -m specdec bench --shape gemma3-270m \
        --context 512 --oracle-tau 6.5 --reps 10 --json $W/b_gemma3_$v.json > $W/b_gemma3_$v.log 2>&1
    echo "== bench $v rc=$?"; grep -vE "^ *(verify|k=)" $W/b_gemma3_$v.log | tail -7 | cut -c1-240
done
timeout 150 python scripts/check_fused_layer.py --shape gemma3-270m --sweep --head --rows 1 --json $W/cfl_gemma3.json \
    > $W/cfl_gemma3.log 2>&1
echo "== check_fused_layer rc=$?"; grep -E "FAIL|us|TILES" $W/cfl_gemma3.log | tail -14 | cut -c1-240
D=/tmp/dc; rm -rf $D
timeout 120 python scripts/device_check.py build $D > $W/dc_build.log 2>&1; echo "== build rc=$?"
for m in graphs eager; do
    timeout 120 python scripts/device_check.py run $D --target gemma3 --mode $m --drafters oracle ngram dflash \
        --prompts 4 --new-tokens 128 --out $W/dc_gemma3_$m.json 2>&1 | tail -1
done
python scripts/device_check.py compare $W/dc_gemma3_*.json 2>&1 | tail -8
cd $OUT && tar czf g.tgz g && rm -rf g
