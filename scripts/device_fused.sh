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
#   (the `combine` mode that measured the since-removed SPECDEC_SPLIT_LAST_COMBINES: at 275368c)
#   three calls back to back: dfast-shape (carry .whl .dev/h1, drafters out), dfast-real (carry .dev/h2, drafters
#       out), dfast-drafters (the full tree): SPECDEC_DFLASH_FAST off and on (see each mode below)
#   (the `qknorm` and `rowexact` modes, for the since-removed SPECDEC_FUSED_QK_NORM_ROPE and SPECDEC_ROPE_TABLE and
#   SPECDEC_ROW_EXACT, run in a shorter form by hand in the session of 2026-12-03 (fourth): at 4cdfa31)
#   (the `qkv` mode that measured the since-removed SPECDEC_QKV_ROPE: at ae48a51)
#   one call (carry .whl):  bash scripts/device_fused.sh split512
#       SPECDEC_SPLIT_KEYS 256 / 512: the SmolLM2 shape end to end alternated, plain_gaps.py, the step costs at long
#       contexts (qwen3-8b shape, 4k and 16k), device_check (random Llama) at 512, then the qwen3-8b shape's 16-row
#       step kernel by kernel; every JSON in one split512.tgz
#   three calls back to back: matrix-1 (the full tree, carry .whl), matrix-2 (carry .dev/h1, drafters out), matrix-3
#       (carry .dev/h2, drafters out): issue 9's sets with today's defaults: GSM8K first 100, HumanEval 164, MT-Bench
#       80 first turns; plain, DFlash, DFlash + n-gram, MTP k=3, n-gram k=3; T=0, -n 128
#   three calls back to back: span-a (carry .whl .dev/h1, drafters out), span-b (carry .dev/h2, drafters out),
#   span-c (the full tree): SPECDEC_SHORT_SPAN off / on: the shape end to end and plain_gaps.py, device_check
#       (random Llama), then the real GGUF plain / n-gram and device_check on it, then the shipped drafters
#   three calls back to back: re-a (carry .whl), re-b (carry .dev/h1, drafters out), re-c (carry .dev/h2, drafters out):
#       SPECDEC_ROW_EXACT + SPECDEC_GREEDY_CHAIN off / on, shape and real GGUF with every shipped drafter, device_check
#   one call (carry .whl [.dev/h1, drafters out]):  bash scripts/device_fused.sh chain
#   then (carry .dev/h2, drafters out):  bash scripts/device_fused.sh chain-real   (the real GGUF, device_check on it)
#       SPECDEC_GREEDY_CHAIN (with and without SPECDEC_ROW_EXACT): plain decoding end to end off / lookahead / chain
#       (ab_lookahead.py, SmolLM2 and qwen3-8b shapes), device_check (random Llama, Qwen3.5) with it on
#   one call (carry .whl):  [COMPILE=1] bash scripts/device_fused.sh drafter-profile
#       the DFlash and MTP drafters' steps on the SmolLM2 shape, kernel by kernel, and profile_engine.py's split
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
ab_shape() {  # VAR "VALUES" NAME: the SmolLM2 shape end to end with VAR at each value, alternated, two rounds
    for r in a b; do
        for v in $2; do
            echo "== $1=$v $r"; env $1=$v timeout 80 python -m specdec bench --shape smollm2-135m --context 128 -n 256 \
                --json $OUT/$3_$v$r.json 2>&1 | grep -E "decode step|dflash|ORACLE|after"
        done
    done
}
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
split512)
    # SPECDEC_SPLIT_KEYS=512: one split, hence no combine, up to position 512 (SHORT_SPAN's steps and DIRECT).
    # Predicted: the SmolLM2 shape plain (positions 128..384) ~1,070 -> ~1,150 tok/s; qwen3-8b's step at 16k a few %
    # slower. Seen (session of 2026-12-03 (sixth)): SmolLM2 +0.3 %, qwen3-8b 4-8 % faster; so now 512 for heads of
    # 128 only (split_attention.split_keys). Run at ed81773 or later, "256" and "512" name SPECDEC_SPLIT_KEYS values.
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    ab_shape SPECDEC_SPLIT_KEYS "256 512" split_shape
    SPECDEC_SPLIT_KEYS=512 timeout 60 python scripts/plain_gaps.py --shape smollm2-135m --context 128 -n 256 \
        --json $OUT/split512_gaps.json 2>&1 | grep -E '"(gpu_step_ms|ms_per_token|tok_per_s)"|"[0-9]+": '
    for v in 256 512; do
        echo "== qwen3-8b split $v"; SPECDEC_SPLIT_KEYS=$v timeout 120 python -m specdec bench --shape qwen3-8b \
            --context 128 --contexts 4096,16384 -n 16 --json $OUT/split_qwen3_$v.json 2>&1 | grep -E "^context|decode step"
    done
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    SPECDEC_SPLIT_KEYS=512 timeout 150 python scripts/device_check.py run /tmp/dc --target llama --mode graphs \
        --out $OUT/dc_split512_llama.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_split512_llama.json 2>&1 | tail -6
    timeout 90 python scripts/profile_shape_step.py --shape qwen3-8b --rows 16 --context 512 > $OUT/profile_qwen3_rows16.json 2>&1
    (cd $OUT && tar czf split512.tgz *.json && rm -f *.json) ;;
matrix-1)
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    rm -rf /tmp/drafters && cp -r specdec/data/drafters/smollm2_135m_instruct /tmp/drafters && ls /tmp/drafters ;;
matrix-2)
    cp .dev/h1/p /tmp/p1 && ls -la /tmp/p1 ;;
matrix-3)
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    for s in "gsm8k 100" "humaneval 164" "mt_bench 80 --max-turns 1"; do
        set -- $s
        echo "== $1"; timeout 170 python -m specdec bench -m $G --dataset $1 --num-prompts $2 ${3:-} ${4:-} -n 128 -k 3 \
            --drafts none dflash:/tmp/drafters/dflash dflash:/tmp/drafters/dflash+ngram mtp:/tmp/drafters/mtp ngram \
            --json $OUT/matrix_$1.json 2>&1 | rows 6
    done ;;
span-a)
    # SPECDEC_SHORT_SPAN (graphs.py), call 1 of 3: the first GGUF half kept; the SmolLM2 shape end to end off / on
    # alternated (contexts 128 .. 384 in a 1024-position cache), plain_gaps.py on, device_check (random Llama) on
    cp .dev/h1/p /tmp/p1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    ab_shape SPECDEC_SHORT_SPAN "0 1" span_shape
    SPECDEC_SHORT_SPAN=1 timeout 60 python scripts/plain_gaps.py --shape smollm2-135m --context 128 -n 256 \
        --json $OUT/span_gaps_on.json 2>&1 | grep -E '"(gpu_step_ms|ms_per_token|tok_per_s)"'
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    SPECDEC_SHORT_SPAN=1 timeout 150 python scripts/device_check.py run /tmp/dc --target llama --mode graphs \
        --out $OUT/dc_span_llama.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_span_llama.json 2>&1 | tail -6 ;;
span-b)
    # call 2 of 3 (carry .dev/h2; drafters out): the GGUF joined; real SmolLM2 plain and n-gram (GSM8K first 80,
    # -n 128) off / on alternated, then device_check on the real weights (8 GSM8K prompts x 256) with it on
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    for r in a b; do
        for f in 0 1; do
            echo "== short-span $f $r"; SPECDEC_SHORT_SPAN=$f python -m specdec bench -m $G --dataset gsm8k \
                --num-prompts 80 -n 128 --drafts none ngram -k 3 --json $OUT/span_real_$f$r.json 2>&1 | rows 3
        done
    done
    SPECDEC_SHORT_SPAN=1 timeout 150 python scripts/device_check.py run /tmp/none --target smollm2 --model $G \
        --gsm8k specdec/data/bench/gsm8k_test.jsonl --mode graphs --prompts 8 --new-tokens 256 \
        --drafters oracle ngram --out $OUT/dc_span_smollm2.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_span_smollm2.json 2>&1 | tail -5 ;;
span-c)
    # call 3 of 3 (the full tree): the shipped DFlash and MTP (GSM8K first 80, -n 128, k = 3) off / on
    for f in 0 1; do
        echo "== short-span $f"; SPECDEC_SHORT_SPAN=$f python -m specdec bench -m $G --dataset gsm8k --num-prompts 80 \
            -n 128 -k 3 --drafts none dflash mtp --json $OUT/span_drafters_$f.json 2>&1 | rows 4
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
drafter-profile)
    # where a drafter's step goes on the SmolLM2 shape (random weights): DFlash's proposal and context
    # write, MTP's proposal (k = 3), kernel by kernel (profile_shape_step.py --drafter), then the engine's
    # own split of a DFlash step (profile_engine.py)
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    for d in dflash mtp; do
        timeout 150 python scripts/profile_shape_step.py --shape smollm2-135m --drafter $d --context 300 --top 30 \
            ${COMPILE:+--compile} > $OUT/profile_drafter_$d.json 2> $OUT/profile_drafter_$d.err
        grep -E '_ms"|kernels"' $OUT/profile_drafter_$d.json; grep -v "^USDT\|Warning" $OUT/profile_drafter_$d.err | tail -3
    done
    timeout 120 python scripts/profile_engine.py --shape smollm2-135m --draft dflash --prompts 4 -n 128 \
        > $OUT/profile_engine_dflash.txt 2>&1; grep -E "^\{" $OUT/profile_engine_dflash.txt ;;
dfast-shape)
    # SPECDEC_DFLASH_FAST and SPECDEC_MTP_FAST (drafters/dflash_fast.py, mtp.FastLayer), call 1 of 3 (carry .whl
    # .dev/h1; the shipped drafters out): the first GGUF half kept; random DFlash and MTP drafters' steps on the
    # SmolLM2 shape, off and on (time and kernels), profile_engine's DFlash step, device_check (random Llama,
    # graphs, every drafter) with both on; all in $OUT/dfast1.tgz
    cp .dev/h1/p /tmp/p1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    O=/tmp/o1; rm -rf $O; mkdir -p $O
    for d in dflash mtp; do
        for f in 0 1 0 1; do
            echo "== $d fast=$f"; SPECDEC_DFLASH_FAST=$f SPECDEC_MTP_FAST=$f timeout 100 python scripts/profile_shape_step.py \
                --shape smollm2-135m --drafter $d --context 300 --top 30 > $O/pd_${d}_fast$f.json 2> $O/pd_${d}_fast$f.err
            grep -E '_ms"|kernels"' $O/pd_${d}_fast$f.json; grep -E "Error|error" $O/pd_${d}_fast$f.err | tail -3
        done
    done
    for f in 0 1; do
        SPECDEC_DFLASH_FAST=$f timeout 120 python scripts/profile_engine.py --shape smollm2-135m --draft dflash --prompts 4 \
            -n 128 > $O/pe_fast$f.txt 2>&1; grep -E "^\{|Error" $O/pe_fast$f.txt
    done
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    SPECDEC_DFLASH_FAST=1 SPECDEC_MTP_FAST=1 timeout 150 python scripts/device_check.py run /tmp/dc --target llama \
        --mode graphs --out $O/dc_fast_llama.json 2>&1 | tail -1
    python scripts/device_check.py compare $O/dc_fast_llama.json 2>&1 | tail -6
    tar czf $OUT/dfast1.tgz -C $O . ;;
dfast-real)
    # call 2 of 3 (carry .dev/h2; drafters still out): the GGUF joined; real SmolLM2 plain decoding end to end
    # (issue 10's number), GSM8K first 80, two rounds
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    for r in a b; do
        echo "== plain $r"; python -m specdec bench -m $G --dataset gsm8k --num-prompts 80 -n 128 --drafts none \
            --json $OUT/real_plain_$r.json 2>&1 | rows 3
    done ;;
dfast-drafters)
    # call 3 of 3 (the full tree): the shipped DFlash and MTP drafters with SPECDEC_DFLASH_FAST and SPECDEC_MTP_FAST
    # off and on, GSM8K and HumanEval (first 80, -n 128, T=0, MTP k=3), then device_check on real weights with the
    # shipped drafters, both on
    O=/tmp/o3; rm -rf $O; mkdir -p $O
    for s in "gsm8k 80" "humaneval 80"; do
        set -- $s
        for f in 0 1; do
            echo "== fast=$f $1"; SPECDEC_DFLASH_FAST=$f SPECDEC_MTP_FAST=$f python -m specdec bench -m $G --dataset $1 \
                --num-prompts $2 -n 128 -k 3 --drafts none dflash dflash+ngram mtp --json $O/e2e_$1_fast$f.json 2>&1 | rows 5
        done
    done
    D=specdec/data/drafters/smollm2_135m_instruct
    SPECDEC_DFLASH_FAST=1 SPECDEC_MTP_FAST=1 timeout 150 python scripts/device_check.py run /tmp/none --target smollm2 \
        --model $G --gsm8k specdec/data/bench/gsm8k_test.jsonl --mode graphs --prompts 8 --new-tokens 256 \
        --drafters dflash:$D/dflash mtp:$D/mtp oracle --out $O/dc_fast_smollm2.json 2>&1 | tail -1
    python scripts/device_check.py compare $O/dc_fast_smollm2.json 2>&1 | tail -5
    tar czf $OUT/dfast3.tgz -C $O . ;;
chain)
    # SPECDEC_GREEDY_CHAIN (engine/generate.py, off): greedy plain decoding on GraphedTarget.greedy_step, the
    # argmax, next input and position inside the step. ab_lookahead.py (off / lookahead / chain interleaved in one
    # process, outputs compared) on the SmolLM2 shape with SPECDEC_ROW_EXACT 0 and 1 and on qwen3-8b; then
    # device_check (random Llama with ROW_EXACT on too, random Qwen3.5) with the chain on: plain output is the
    # reference every accepted drafter's output is compared with
    [ -f .dev/h1/p ] && cp .dev/h1/p /tmp/p1  # first half of the GGUF, for chain-real
    pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
    for r in 0 1; do
        echo "== smollm2 row-exact $r"; SPECDEC_ROW_EXACT=$r timeout 90 python scripts/ab_lookahead.py --shape smollm2-135m \
            --prompts 8 -n 256 --chain --json $OUT/chain_smollm2_rowexact$r.json 2>&1 | tail -1
    done
    echo "== qwen3-8b"; timeout 120 python scripts/ab_lookahead.py --shape qwen3-8b --prompts 4 -n 256 --chain \
        --json $OUT/chain_qwen3_8b.json 2>&1 | tail -1
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    SPECDEC_GREEDY_CHAIN=1 SPECDEC_ROW_EXACT=1 timeout 150 python scripts/device_check.py run /tmp/dc --target llama \
        --mode graphs --out $OUT/dc_chain_llama.json 2>&1 | tail -1
    SPECDEC_GREEDY_CHAIN=1 timeout 150 python scripts/device_check.py run /tmp/dc --target qwen35 \
        --mode graphs --out $OUT/dc_chain_qwen35.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_chain_*.json 2>&1 | tail -10 ;;
chain-real)
    # after `chain` with .dev/h1 carried (carry .dev/h2; drafters out): the real SmolLM2 GGUF, plain decoding off /
    # lookahead / chain (ab_lookahead.py, GSM8K first 80, -n 128) with SPECDEC_ROW_EXACT 0 and 1, then device_check
    # on the real weights (8 GSM8K prompts x 256, spoiled oracle, n-gram) with the chain and ROW_EXACT on
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    for r in 0 1; do
        echo "== real row-exact $r"; SPECDEC_ROW_EXACT=$r timeout 150 python scripts/ab_lookahead.py --model $G \
            --dataset gsm8k --prompts 80 -n 128 --chain --json $OUT/chain_real_rowexact$r.json 2>&1 | tail -1
    done
    SPECDEC_GREEDY_CHAIN=1 SPECDEC_ROW_EXACT=1 timeout 150 python scripts/device_check.py run /tmp/none --target smollm2 \
        --model $G --gsm8k specdec/data/bench/gsm8k_test.jsonl --mode graphs --prompts 8 --new-tokens 256 \
        --drafters oracle ngram --out $OUT/dc_chain_smollm2.json 2>&1 | tail -1
    python scripts/device_check.py compare $OUT/dc_chain_smollm2.json 2>&1 | tail -5 ;;
re-a|re-b|re-c)
    # SPECDEC_ROW_EXACT with SPECDEC_GREEDY_CHAIN, three calls back to back: re-a (the full tree, carry .whl): the shipped
    # drafters to /tmp/drafters, the SmolLM2 shape end to end off / on alternated, device_check (random Llama) on;
    # re-b (carry .dev/h1, drafters out): the GGUF's first half; re-c (carry .dev/h2, drafters out): the real GGUF,
    # plain and every shipped drafter (GSM8K first 80, -n 128, k = 3) off / on, device_check on real weights on
    O=/tmp/o5; mkdir -p $O
    case "$1" in
    re-a)
        rm -rf /tmp/drafters && cp -r specdec/data/drafters/smollm2_135m_instruct /tmp/drafters
        pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
        for r in a b; do
            for f in 0 1; do
                echo "== row-exact $f $r"; SPECDEC_ROW_EXACT=$f SPECDEC_GREEDY_CHAIN=$f timeout 80 python -m specdec bench \
                    --shape smollm2-135m --context 128 -n 256 --json $O/shape_re$f$r.json 2>&1 | grep -E "dflash|mtp|ORACLE|after"
            done
        done
        python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
        SPECDEC_ROW_EXACT=1 SPECDEC_GREEDY_CHAIN=1 timeout 150 python scripts/device_check.py run /tmp/dc --target llama \
            --mode graphs --out $O/dc_re_llama.json 2>&1 | tail -1
        python scripts/device_check.py compare $O/dc_re_llama.json 2>&1 | tail -6 ;;
    re-b) cp .dev/h1/p /tmp/p1 && ls -la /tmp/p1 ;;
    re-c)
        cat /tmp/p1 .dev/h2/p > $G && md5sum $G
        for f in 0 1; do
            echo "== row-exact $f"; SPECDEC_ROW_EXACT=$f SPECDEC_GREEDY_CHAIN=$f python -m specdec bench -m $G --dataset gsm8k \
                --num-prompts 80 -n 128 -k 3 --drafts none dflash dflash+ngram mtp ngram --json $O/e2e_re$f.json 2>&1 | rows 6
        done
        SPECDEC_ROW_EXACT=1 SPECDEC_GREEDY_CHAIN=1 timeout 150 python scripts/device_check.py run /tmp/none --target smollm2 \
            --model $G --gsm8k specdec/data/bench/gsm8k_test.jsonl --mode graphs --prompts 8 --new-tokens 256 \
            --drafters dflash:/tmp/drafters/dflash mtp:/tmp/drafters/mtp oracle ngram --out $O/dc_re_smollm2.json 2>&1 | tail -1
        python scripts/device_check.py compare $O/dc_re_smollm2.json 2>&1 | tail -6 ;;
    esac
    tar czf $OUT/$1.tgz -C $O . ;;
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
    echo "usage: bash scripts/device_fused.sh shape|real|drafters|profile|attn|drafter-profile|dfast-shape|dfast-real|dfast-drafters|qknorm|rowexact|final|serve (see the top of this file)" >&2
    exit 2 ;;
esac
