#!/bin/bash
# Issue 10 on the device machine (H200), one call (carry .whl): split K in the fused GEMM (fused_layer.SPLIT_K), the
# combine's fixed (4, 8) cut, the shape bench's warm-up at 16,000 tokens of context:
#   bash scripts/device_splitk.sh          # 1. check_fused_layer.py --sweep on qwen3-8b's weights (tilings x splits 1-4,
#                                          #    the drafters' fc / kv weights too); 2. ab_flags.py at context 512 with the
#                                          #    sweep's best tiles: defaults, defaults-split-k, defaults+cut4
#   bash scripts/device_splitk.sh tiles    # device_check with split K and the (4, 8) cut; ab_flags: the cut, o / q/k/v /
#                                          # down split (qwen3-8b, 512 and 16,000; qwen3.5-9b); bench qwen3-8b at 16,000
#   bash scripts/device_splitk.sh hybrid   # a dense Qwen3.5 on the fused GEMM: device_check (qwen35, qwen35moe), ab_flags
#                                          # defaults / defaults-hybrid, bench qwen3.5-9b and qwen3-8b at 512
#   bash scripts/device_splitk.sh moe      # device_check on random Llama, Qwen3 (split K forced), Qwen3.5 dense and MoE;
#                                          # ab_flags qwen3.5-35b-a3b defaults / defaults-hybrid; its bench
#   bash scripts/device_splitk.sh moe-tiles # qwen3.5-35b-a3b: its 2048-wide GEMMs and head swept at 1 row; ab_flags defaults
#                                          # / defaults+tiles (the sweep's best, AB_TILES) / defaults+moe-bmm; the step's profile
#   bash scripts/device_splitk.sh moe-final # device_check qwen35moe / qwen35; bench qwen3.5-35b-a3b; ab_flags defaults /
#                                          # defaults-split-k
#   bash scripts/device_splitk.sh moe-check # SPECDEC_MOE_GROUPED_BMM=1: device_check qwen35moe, bench qwen3.5-35b-a3b;
#                                          # ab_flags defaults / defaults+moe-bmm (the prefill)
#   bash scripts/device_splitk.sh final    # bench --shape qwen3-8b (512, 16,000), qwen3.5-9b, smollm2-135m; device_check
#                                          # on random Llama / Qwen3 with every unnamed weight on split K (TILES_STAR);
#                                          # ab_flags: the shipped split K and cut against none / the old cut
# Everything comes back in one r.tgz (the machine returns at most 8 files).
set -u
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
TILES_STAR='{"*": [16, 128, 2, 4, 2]}'  # device_check's hidden-1024 models: every weight the table does not name split 2
check() {  # device_check [TARGET ...] (default: random Llama and Qwen3): graphs, eager; oracle, n-gram, MTP, DFlash
    # drafts; every weight the tile table does not name on split K
    SPECDEC_FUSED_LAYER_TILES="$TILES_STAR" python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in ${@:-llama qwen3}; do
        for m in graphs eager; do
            SPECDEC_FUSED_LAYER_TILES="$TILES_STAR" timeout 45 python scripts/device_check.py run /tmp/dc --target $t \
                --mode $m --drafters oracle ngram mtp dflash --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > /dev/null 2>&1
        done
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -4
}
bench() {  # bench --shape NAME --context C [more args]: the log's summary lines
    local name=$1 ctx=$2; shift 2
    timeout 170 python -m specdec bench --shape $name --context $ctx --oracle-tau 6.5 --json $R/b_${name}_$ctx.json "$@" \
        > $R/b_${name}_$ctx.log 2>&1
    grep -vE "^ *(verify|k=)" $R/b_${name}_$ctx.log | tail -7
}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "${1:-}" = tiles ]; then  # split K per weight and the (4, 8) cut in the step; their exactness; the 16k bench
    SPECDEC_COMBINE_CUT=4,8 check
    timeout 150 python scripts/ab_flags.py --shape qwen3-8b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+cut4 defaults+o2 defaults+qkv4 defaults+down4 --json $R/ab8b_512.json > $R/ab8b_512.log 2>&1
    tail -7 $R/ab8b_512.log
    timeout 110 python scripts/ab_flags.py --shape qwen3-8b --context 16000 --rounds 3 --reps 10 --no-drafters \
        --variants defaults defaults+cut4 --json $R/ab8b_16k.json > $R/ab8b_16k.log 2>&1
    tail -4 $R/ab8b_16k.log
    SPECDEC_COMBINE_CUT=4,8 bench qwen3-8b 16000
    timeout 90 python scripts/ab_flags.py --shape qwen3.5-9b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+cut4 --json $R/ab9b.json > $R/ab9b.log 2>&1
    tail -4 $R/ab9b.log
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = hybrid ]; then  # a dense Qwen3.5 target on the fused GEMM (row-exact): exactness, step, bench
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in qwen35 qwen35moe; do
        for m in graphs eager; do
            timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode $m --drafters oracle ngram mtp dflash \
                --prompts 4 --new-tokens 128 --out $R/dc_${t}_$m.json > $R/dc_${t}_$m.log 2>&1
        done
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -20
    timeout 120 python scripts/ab_flags.py --shape qwen3.5-9b --context 512 --rounds 3 \
        --variants defaults defaults-hybrid --json $R/ab9b.json > $R/ab9b.log 2>&1
    tail -4 $R/ab9b.log
    bench qwen3.5-9b 512 --draft-vocab 32768
    bench qwen3-8b 512
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
pack() { (cd $OUT && tar czf r.tgz r); }  # after every stage: a run cut short still brings back what it measured
if [ "${1:-}" = moe ]; then  # the last tree: device_check on every random target; the MoE shape row-exact
    check llama qwen3 qwen35 qwen35moe
    pack
    timeout 130 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults-hybrid --json $R/ab35b.json > $R/ab35b.log 2>&1
    tail -4 $R/ab35b.log
    pack
    bench qwen3.5-35b-a3b 512 --draft-vocab 32768
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = moe-tiles ]; then  # the 2048-wide GEMMs of qwen3.5-35b-a3b at 1 row (plain decoding's step): a sweep,
    # the step with its best tilings against the defaults (and the grouped-GEMM MoE prefill), where the 1-row step goes
    timeout 300 python scripts/check_fused_layer.py --shape qwen3.5-35b-a3b --sweep --head --rows 1 --no-model \
        --only qkv delta_in delta_out head --json $R/cfl35b.json > $R/cfl35b.log 2>&1
    grep -v "^  .*tile .* us$" $R/cfl35b.log | tail -12
    TILES=$(python -c "import json;print(json.dumps(json.load(open('$R/cfl35b.json'))['best_tiles']))" 2>/dev/null || echo '{}')
    echo "TILES=$TILES"
    pack
    AB_TILES="$TILES" timeout 200 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+tiles defaults+moe-bmm --json $R/ab35b.json > $R/ab35b.log 2>&1
    tail -5 $R/ab35b.log
    pack
    timeout 120 python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --rows 1 --context 512 --top 30 > $R/prof35b.log 2>&1
    grep -E "ms|span|bound" $R/prof35b.log | head -12
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = moe-check ]; then  # the grouped MoE prefill (moe.GROUPED_BMM, forced on): the MoE target's exactness
    # (device_check) and the 35b bench (its oracle's output against plain decoding's); then the prefill A/B
    export SPECDEC_MOE_GROUPED_BMM=1
    check qwen35moe
    pack
    bench qwen3.5-35b-a3b 512 --draft-vocab 32768
    pack
    unset SPECDEC_MOE_GROUPED_BMM
    timeout 150 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+moe-bmm --json $R/ab35b_bmm.json > $R/ab35b_bmm.log 2>&1
    tail -4 $R/ab35b_bmm.log
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = moe-final ]; then  # the 35b's tiles and grouped MoE prefill as shipped: exactness on random Qwen3.5
    # dense and MoE targets (graphs), the MoE shape's bench, and its 1-row step's grouped-prefill A/B
    check qwen35moe qwen35
    pack
    bench qwen3.5-35b-a3b 512 --draft-vocab 32768
    pack
    timeout 150 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults-split-k --json $R/ab35b_final.json > $R/ab35b_final.log 2>&1
    tail -4 $R/ab35b_final.log
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
if [ "${1:-}" = final ]; then
    bench qwen3-8b 512
    timeout 110 python scripts/ab_flags.py --shape qwen3-8b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults-split-k defaults+cut16 --json $R/ab8b_final.json > $R/ab8b_final.log 2>&1
    tail -5 $R/ab8b_final.log
    check
    bench qwen3-8b 16000
    bench smollm2-135m 300 --draft-vocab 16384
    bench qwen3.5-9b 512 --draft-vocab 32768
    cd $OUT && tar czf r.tgz r && rm -rf r
    exit 0
fi
timeout 330 python scripts/check_fused_layer.py --shape qwen3-8b --sweep \
    --only qkv o gate_up+silu down dflash_fc dflash_kv mtp_fc --json $R/cfl8b.json > $R/cfl8b.log 2>&1
grep -v "^  .*tile .* us$" $R/cfl8b.log | tail -25
TILES=$(python -c "import json;print(json.dumps(json.load(open('$R/cfl8b.json'))['best_tiles']))" 2>/dev/null || echo '{}')
echo "TILES=$TILES"
SPECDEC_FUSED_LAYER_TILES="$TILES" timeout 200 python scripts/ab_flags.py --shape qwen3-8b --context 512 --rounds 3 \
    --variants defaults defaults-split-k defaults+cut4 --json $R/ab8b.json > $R/ab8b.log 2>&1
tail -6 $R/ab8b.log
cd $OUT && tar czf r.tgz r && rm -rf r
