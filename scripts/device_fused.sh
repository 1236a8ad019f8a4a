#!/bin/bash
# The fused Llama layer (models/fused_layer.py) and the one-split attention (split_attention.DIRECT), on
# by default, against both off ("old": SPECDEC_FUSED_LAYER=0 SPECDEC_SPLIT_DIRECT=0) on the device
# machine (H200), in three back-to-back calls (the 98 MB GGUF travels in halves; the shipped drafters
# do not fit beside one, and a machine idle for ~30 s goes back with the first half):
#   call 1 (carry .whl .dev/h1; the shipped drafters moved out of the tree):  bash scripts/device_fused.sh shape
#       the random-weight SmolLM2 shape end to end (specdec bench --shape), old and new alternated
#   call 2 (carry .dev/h2; drafters still out):  bash scripts/device_fused.sh real
#       real SmolLM2 weights: device_check (GSM8K prompts, spoiled oracle, n-gram), plain and n-gram
#       end to end, old and new alternated
#   call 3 (the full tree):  bash scripts/device_fused.sh drafters
#       the shipped DFlash and MTP end to end on GSM8K and HumanEval, old and new
#   (the `pdl` mode that measured SPECDEC_PDL and the since-removed L2 prefetch: at 8c72ceb)
#   one call:  bash scripts/device_fused.sh profile
#       SmolLM2's 16-row step, kernel by kernel (scripts/profile_shape_step.py), uncaptured and one graph replay
#   one call (carry .whl):  [SWEEP=1] bash scripts/device_fused.sh attn
#       (SWEEP: the split attention at decode contexts, scripts/sweep_split_attention.py --decode: tiles,
#       SPLIT), the step with 64-row and 16-row query tiles (SPECDEC_SPLIT_SMALL_TILES; ab_flags.py)
#   one call (carry .whl):  bash scripts/device_fused.sh combine
#       SPECDEC_SPLIT_LAST_COMBINES: bits against the combine kernel, the step past one split (SmolLM2 at 300
#       and 1000, qwen3-8b at 1000), device_check on random Llama and Qwen3.5 with it on
#   one call (carry .whl):  [OLD_FLAGS=...] [ROUNDS="a b"] [TARGETS="llama qwen35"] bash scripts/device_fused.sh final
#       the defaults against the session-19 ones (SPECDEC_PDL=0 SPECDEC_SPLIT_SMALL_TILES=0, or OLD_FLAGS) on the
#       shape end to end, and device_check (random Llama and Qwen3.5) with the defaults
#   one call (carry .whl):  bash scripts/device_fused.sh serve
#       the serving loop (scripts/bench_serve.py, random SmolLM2 shape, 1 / 8 / 32 clients), old
#       (SPECDEC_FUSED_LAYER=0 SPECDEC_SPLIT_DIRECT=0) and new
# Every output goes to $OUT.
set -u
G=/tmp/smol.gguf
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sd() { python -m specdec "$@"; }
old() { SPECDEC_FUSED_LAYER=0 SPECDEC_SPLIT_DIRECT=0 python -m specdec "$@"; }
rows() { grep -E "^\||tok/s|step" | grep -v "^|---" | tail -"$1"; }
case "${1:-}" in
shape)
    cp .dev/h1/p /tmp/p1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    for r in a b; do
        for v in old new; do
            run=sd; [ $v = old ] && run=old
            echo "== $v $r"; $run bench --shape smollm2-135m --context 128 -n 256 --json $OUT/shape_$v$r.json 2>&1 | rows 6
        done
    done ;;
real)
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    python scripts/device_check.py run /tmp/none --target smollm2 --model $G --gsm8k specdec/data/bench/gsm8k_test.jsonl \
        --mode graphs --prompts 8 --new-tokens 256 --drafters oracle ngram --out $OUT/dc_smollm2_graphs.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_smollm2_graphs.json 2>&1 | tail -5
    for r in a b; do
        for v in old new; do
            run=sd; [ $v = old ] && run=old
            echo "== $v $r"; $run bench -m $G --dataset gsm8k --num-prompts 40 -n 128 --drafts none ngram -k 3 \
                --json $OUT/e2e_gsm8k_$v$r.json 2>&1 | rows 6
        done
    done ;;
drafters)
    for s in "gsm8k 80" "humaneval 80"; do
        set -- $s
        for v in old new; do
            run=sd; [ $v = old ] && run=old
            echo "== $v $1"; $run bench -m $G --dataset $1 --num-prompts $2 -n 128 -k 3 \
                --drafts none dflash dflash+ngram mtp --json $OUT/e2e_$1_drafters_$v.json 2>&1 | rows 6
        done
    done ;;
profile)
    for p in 0 1; do
        echo "== SPECDEC_PDL=$p"; SPECDEC_PDL=$p timeout 120 python scripts/profile_shape_step.py --shape smollm2-135m \
            --rows 16 --context 100 --top 14 > $OUT/profile_smollm2_pdl$p.json 2> $OUT/profile_pdl$p.err
        grep -E '_ms"|kernels"' $OUT/profile_smollm2_pdl$p.json; grep -v "^USDT\|Warning" $OUT/profile_pdl$p.err | tail -3
    done ;;
attn)
    # the split attention at decode contexts (its tiles and SPLIT swept), then the step with the 64-row
    # query tiles (session 19) and the 16-row ones (SPECDEC_SPLIT_SMALL_TILES, the default since)
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    [ -n "${SWEEP:-}" ] && timeout 200 python scripts/sweep_split_attention.py --decode --json $OUT/sweep_decode.json \
        > $OUT/sweep_decode.log 2>&1
    for c in 100 300; do
        timeout 100 python scripts/ab_flags.py --shape smollm2-135m --context $c -n 128 --rounds 4 --no-drafters \
            --variants fused+direct+pdl fused+direct+pdl+small-tiles --json $OUT/ab_tiles_c$c.json 2>&1 | tail -3
    done ;;
combine)
    # SPECDEC_SPLIT_LAST_COMBINES (no combine launch past one split): its bits against the combine kernel
    # (check_split_attention.py), the step past one split, device_check with it on
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    timeout 200 python scripts/check_split_attention.py --json $OUT/split_check_lc.json > $OUT/split_check_lc.log 2>&1
    grep -E "last_combines|failures" $OUT/split_check_lc.log | cut -c1-300
    for sc in "smollm2-135m 300" "smollm2-135m 1000" "qwen3-8b 1000"; do
        set -- $sc
        timeout 120 python scripts/ab_flags.py --shape $1 --context $2 -n 128 --rounds 4 --no-drafters \
            --variants fused+direct+pdl+small-tiles fused+direct+pdl+small-tiles+last-combines \
            --json $OUT/ab_lc_$1_c$2.json 2>&1 | tail -3
    done
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen35; do
        SPECDEC_SPLIT_LAST_COMBINES=1 timeout 100 python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --out $OUT/dc_lc_$t.json 2>&1 | tail -1
    done
    python scripts/device_check.py compare $OUT/dc_lc_*.json 2>&1 | tail -11 ;;
final)
    # the defaults now against the session-19 defaults (OLD_FLAGS), end to end on the shape, alternated;
    # then device_check (random Llama on the fused layers, random Qwen3.5) with the defaults
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    for r in ${ROUNDS:-a b}; do
        for v in s19 new; do
            f="SPECDEC_UNUSED=1"; [ $v = s19 ] && f="${OLD_FLAGS:-SPECDEC_PDL=0 SPECDEC_SPLIT_SMALL_TILES=0}"
            echo "== $v $r ($f)"; env $f timeout 80 python -m specdec bench --shape smollm2-135m --context 128 -n 256 \
                --json $OUT/final_shape_$v$r.json 2>&1 | rows 3
        done
    done
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in ${TARGETS:-llama qwen35}; do
        timeout 100 python scripts/device_check.py run /tmp/dc --target $t --mode graphs --out $OUT/dc_final_$t.json 2>&1 | tail -1
    done
    python scripts/device_check.py compare $OUT/dc_final_*.json 2>&1 | tail -11 ;;
serve)
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    for r in a b; do
        for v in old new; do
            run=python; [ $v = old ] && run="env SPECDEC_FUSED_LAYER=0 SPECDEC_SPLIT_DIRECT=0 python"
            echo "== $v $r"; timeout 200 $run scripts/bench_serve.py --shape smollm2-135m --drafts none oracle \
                --concurrency 1 8 32 --requests 4 --json $OUT/serve_$v$r.json 2>&1 \
                | grep -E "tokens_per_s_median|reference_equal"
        done
    done ;;
*)
    echo "usage: bash scripts/device_fused.sh shape|real|drafters|profile|attn|combine|final|serve (see the top of this file)" >&2
    exit 2 ;;
esac
