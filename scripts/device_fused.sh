#!/bin/bash
# The fused Llama layer (models/fused_layer.py, SPECDEC_FUSED_LAYER) on the device machine (H200), in
# three back-to-back calls (the 98 MB GGUF travels in halves; the shipped drafters do not fit beside one):
#   call 1 (carry .whl .dev/h1; the shipped drafters moved out of the tree):  bash scripts/device_fused.sh kernels
#       the kernels' checks and times, the step A/B, the shape bench on and off, device_check (random Llama)
#   call 2 (carry .dev/h2; drafters still out):  bash scripts/device_fused.sh real
#       real SmolLM2 weights: device_check with GSM8K prompts, plain and n-gram end to end on and off
#   call 3 (the full tree):  bash scripts/device_fused.sh drafters
#       the shipped DFlash and MTP end to end, on and off
# Every output goes to $OUT; each process with the layer off runs beside one with it on, alternated.
set -u
G=/tmp/smol.gguf
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sd() { python -m specdec "$@"; }
case "$1" in
kernels)
    cp .dev/h1/p /tmp/p1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl
    python scripts/check_fused_layer.py --json $OUT/check_fused_layer.json 2>&1 | tail -40
    python scripts/ab_flags.py --shape smollm2-135m --context 300 --rounds 5 --no-drafters \
        --variants base direct fused-layer fused+direct --json $OUT/ab_flags_smollm2.json 2>/dev/null
    for f in 0 1; do
        SPECDEC_FUSED_LAYER=$f sd bench --shape smollm2-135m --context 128 -n 256 --json $OUT/shape_smollm2_fused$f.json 2>&1 \
            | grep -v "^ *$" | tail -14
    done
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    python scripts/device_check.py run /tmp/dc --target llama --mode graphs --out $OUT/dc_llama_graphs.json 2>&1 | tail -3
    python scripts/device_check.py run /tmp/dc --target llama --mode eager --prompts 2 --new-tokens 96 \
        --drafters oracle ngram --out $OUT/dc_llama_eager.json 2>&1 | tail -3
    python scripts/device_check.py compare $OUT/dc_llama_graphs.json 2>&1 | tail -12 ;;
real)
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    python scripts/device_check.py run /tmp/dc --target smollm2 --model $G --gsm8k specdec/data/bench/gsm8k_test.jsonl \
        --mode graphs --prompts 8 --new-tokens 256 --drafters oracle ngram --out $OUT/dc_smollm2_graphs.json 2>&1 | tail -3
    python scripts/device_check.py compare $OUT/dc_smollm2_graphs.json 2>&1 | tail -8
    for r in a b; do
        for f in 0 1; do
            SPECDEC_FUSED_LAYER=$f sd bench -m $G --dataset gsm8k --num-prompts 40 -n 128 --drafts none ngram -k 3 \
                --json $OUT/e2e_gsm8k_fused${f}_$r.json 2>&1 | grep -E "^\|" | tail -4
        done
    done ;;
drafters)
    D=specdec/data/drafters/smollm2_135m_instruct
    for s in "gsm8k 80" "humaneval 80"; do
        set -- $s
        for f in 0 1; do
            SPECDEC_FUSED_LAYER=$f sd bench -m $G --dataset $1 --num-prompts $2 -n 128 -k 3 \
                --drafts none dflash dflash+ngram mtp --json $OUT/e2e_$1_drafters_fused$f.json 2>&1 | grep -E "^\|" | tail -6
        done
    done ;;
esac
