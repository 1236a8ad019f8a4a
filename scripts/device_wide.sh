#!/bin/bash
# Issue 10 on the device machine (H200), one call (carry .whl): the fused Triton GEMMs on 4096-wide layers
# (fused_layer.WIDE, the qwen3-8b shape) and the split kernel's branch-free walk (split_attention.PIPELINE):
#   bash scripts/device_wide.sh          # the sweep (1-4 below)
#   bash scripts/device_wide.sh splits   # WIDE with the split attention's keys a split (64-512) at contexts 512
#                                        # and 4,096; SmolLM2's L2 prefetch; bench --shape qwen3-8b WIDE on and off
#   bash scripts/device_wide.sh keys     # keys a split (128-512) at contexts 512 and 16,000, the combine's cut
#   bash scripts/device_wide.sh verify   # device_check on random Llama / Qwen3, the qwen3-8b oracle; the combine's cut
#   bash scripts/device_wide.sh final    # bench --shape qwen3-8b (512, 16,000), qwen3.5-9b, smollm2-135m; device_check
#   bash scripts/device_wide.sh check    # keys a split at context 16,000; device_check on random Llama and Qwen3
#                                        # (graphs, eager; oracle, n-gram, MTP, DFlash); bench --shape qwen3-8b
# 1. check_fused_layer.py on qwen3-8b with WIDE: bits, time against cuBLAS, every tiling of WIDE_SWEEP (the best
#    tiles go on to the later steps through SPECDEC_FUSED_LAYER_TILES);
# 2. ab_flags.py on qwen3-8b: cuBLAS (defaults-wide) against the wide GEMMs (+ whole weights / nothing prefetched into L2);
# 3. profile_shape_step.py: qwen3-8b's 1-row step with WIDE (where its time goes);
# 4. ab_flags.py on smollm2-135m: defaults against defaults-pipeline and defaults+pfall.
# Everything comes back in one r.tgz (the machine returns at most 8 files).
set -u
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
check() {  # device_check on random Llama and Qwen3 (graphs, eager; oracle, n-gram, MTP, DFlash drafts)
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen3; do
        for m in graphs eager; do
            timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode $m --drafters oracle ngram mtp dflash \
                --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > /dev/null 2>&1
        done
    done
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "${1:-}" = verify ]; then  # the shipped defaults' exactness (device_check, the oracle); the combine's (4, 8) cut timed
    check
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -14
    timeout 110 python -m specdec bench --shape qwen3-8b --context 512 --oracle-tau 6.5 --json $R/b8b_512.json > $R/b8b_512.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b8b_512.log | tail -7
    for c in 512 16000; do
        timeout 100 python scripts/ab_flags.py --shape qwen3-8b --context $c --rounds 3 --reps 10 --no-drafters \
            --variants defaults defaults+cut4 defaults+split512 --json $R/ab8b_cut_$c.json > $R/ab8b_cut_$c.log 2>&1
        tail -5 $R/ab8b_cut_$c.log
    done
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = final ]; then  # the shipped defaults: shape benches, device_check
    timeout 110 python -m specdec bench --shape qwen3-8b --context 512 --oracle-tau 6.5 --json $R/b8b_512.json > $R/b8b_512.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b8b_512.log | tail -7
    timeout 150 python -m specdec bench --shape qwen3-8b --context 16000 --oracle-tau 6.5 --json $R/b8b_16k.json > $R/b8b_16k.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b8b_16k.log | tail -7
    timeout 120 python -m specdec bench --shape qwen3.5-9b --context 512 --draft-vocab 32768 --json $R/b9b.json > $R/b9b.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b9b.log | tail -7
    timeout 60 python -m specdec bench --shape smollm2-135m --context 300 --draft-vocab 16384 --json $R/bsmol.json > $R/bsmol.log 2>&1
    grep -vE "^ *(verify|k=)" $R/bsmol.log | tail -7
    check
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -3
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = keys ]; then  # keys a split for heads of 128 at contexts 512 and 16,000; the combine's cut
    for c in 512 16000; do
        timeout 170 python scripts/ab_flags.py --shape qwen3-8b --context $c --rounds 3 --reps 10 --no-drafters \
            --variants defaults defaults+cut4 defaults+split128 defaults+split512 --json $R/ab8b_keys_$c.json \
            > $R/ab8b_keys_$c.log 2>&1
        tail -6 $R/ab8b_keys_$c.log
    done
    timeout 60 python scripts/ab_flags.py --shape smollm2-135m --context 512 --rounds 5 --no-drafters \
        --variants defaults defaults+cut4 defaults+pfall --json $R/absmol_cut.json > $R/absmol_cut.log 2>&1
    tail -5 $R/absmol_cut.log
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = check ]; then
    timeout 200 python scripts/ab_flags.py --shape qwen3-8b --context 16000 --rounds 3 --reps 10 --no-drafters \
        --variants defaults defaults+split256 defaults+split512 --json $R/ab8b_16k.json > $R/ab8b_16k.log 2>&1
    tail -5 $R/ab8b_16k.log
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen3; do
        for m in graphs eager; do
            timeout 100 python scripts/device_check.py run /tmp/dc --target $t --mode $m --drafters oracle ngram mtp dflash \
                --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json 2>&1 | tail -1
        done
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -12
    timeout 150 python -m specdec bench --shape qwen3-8b --context 512 --oracle-tau 6.5 --json $R/bench8b.json \
        > $R/bench8b.log 2>&1
    grep -vE "^ *(verify|k=)" $R/bench8b.log | tail -8
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = splits ]; then
    for c in 512 4096; do
        timeout 150 python scripts/ab_flags.py --shape qwen3-8b --context $c --rounds 3 --no-drafters \
            --variants defaults-wide defaults defaults+split64 defaults+split128 defaults+split256 \
            --json $R/ab8b_splits_$c.json > $R/ab8b_splits_$c.log 2>&1
        tail -7 $R/ab8b_splits_$c.log
    done
    timeout 60 python scripts/ab_flags.py --shape smollm2-135m --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+pfall defaults+pf0 --json $R/absmol_pf.json > $R/absmol_pf.log 2>&1
    tail -5 $R/absmol_pf.log
    for w in 1 0; do
        SPECDEC_FUSED_LAYER_WIDE=$w timeout 170 python -m specdec bench --shape qwen3-8b --context 512 --oracle-tau 6.5 \
            --json $R/bench8b_wide$w.json > $R/bench8b_wide$w.log 2>&1
        grep -vE "^ *(verify|k=)" $R/bench8b_wide$w.log | tail -14
    done
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
SPECDEC_FUSED_LAYER_WIDE=1 timeout 230 python scripts/check_fused_layer.py --shape qwen3-8b --sweep --head \
    --json $R/cfl8b.json > $R/cfl8b.log 2>&1
grep -v "^  .*tile .* us$" $R/cfl8b.log | tail -25
TILES=$(python -c "import json;print(json.dumps(json.load(open('$R/cfl8b.json'))['best_tiles']))" 2>/dev/null || echo '{}')
echo "TILES=$TILES"
SPECDEC_FUSED_LAYER_TILES="$TILES" timeout 170 python scripts/ab_flags.py --shape qwen3-8b --context 512 --rounds 3 \
    --no-drafters --variants defaults-wide defaults defaults+pfall defaults+pf0 --json $R/ab8b.json \
    > $R/ab8b.log 2>&1
tail -7 $R/ab8b.log
SPECDEC_FUSED_LAYER_TILES="$TILES" SPECDEC_FUSED_LAYER_WIDE=1 timeout 60 python scripts/profile_shape_step.py \
    --shape qwen3-8b --rows 1 --context 512 > $R/prof8b_row1.json 2> $R/prof8b_row1.err
python -c "import json;d=json.load(open('$R/prof8b_row1.json'));print({k:v for k,v in d.items() if not isinstance(v,(list,dict))})" 2>&1 | head -3
timeout 70 python scripts/ab_flags.py --shape smollm2-135m --context 512 --rounds 3 --no-drafters \
    --variants defaults defaults-pipeline defaults+pfall --json $R/absmol.json > $R/absmol.log 2>&1
tail -6 $R/absmol.log
cd $OUT && tar czf r.tgz r && rm -rf r
