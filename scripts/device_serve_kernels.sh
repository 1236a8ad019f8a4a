#!/bin/bash
# The 2026-11-30 measurements on nvidia-h200-x2 (BENCHMARKS.md), one device call each (< 10 min).
# Subcommands that need SmolLM2 want the GGUF at /tmp/smollm2.gguf (or /tmp/part1 + .dev/b/part2:
# the two-call upload of BENCHMARKS.md). Results go to $OUT/all.tgz (one file: $OUT brings back few).
#   micro        all-reduce (NCCL, NCCL_PROTO=LL, one-shot), GEMM sweep, then on GPU 0 the serving
#                benchmark (exact and not) and T=1 DFlash, on GPU 1 the GEMM sweep
#   tp           qwen3-8b shape compiled: TP=1, TP=2 (one-shot all-reduce), TP=2 (NCCL only)
#   serve        serving at context 1024 (exact and not), SDPA span check, qwen3-8b step profiles
#   determinism  plain serving, each prompt alone twice: static exact, static not exact, eager
#   buckets      serving with span buckets (GPU 0) against the whole context (GPU 1)
#   reuse        serving with span buckets and kept slot drafters (GPU 0); plain serving with span
#                buckets, each prompt alone twice (GPU 1)
#   slots        DFlash serving with one drafter step for all slots (GPU 0) against a pass per slot (GPU 1)
# One GPU (nvidia-h200), 2026-12-01:
#   serve1       SmolLM2 serving (none, ngram, DFlash a pass per slot), DFlash with one step for all
#                slots, then the width-invariance check on the smollm2-135m and qwen3-8b shapes
#   shape        serving a random qwen3-8b-shape target, plain and an oracle drafter (tau 4, k 15),
#                controller on, then the oracle with the controller off
#   serve2       SmolLM2 serving (none, ngram, DFlash all-slots; 1-wide checked k = 0 steps), DFlash
#                with wide k = 0 steps, DFlash a pass per slot; then the qwen3-8b shape with the oracle
#   serve3       SmolLM2 serving with slot buckets and checked shapes (none, ngram, DFlash), the same
#                with full steps only; then the qwen3-8b shape with the oracle
#   serve4       serve3 with warm-up (steps built and checked before serving), then the loop's host
#                profile (one request, plain and DFlash)
#   serve5       serve4's serving runs (the controller's prior and margin), then the qwen3-8b shape
#   serve6       the qwen3-8b shape with row-invariant GEMMs, then SmolLM2 serving
#   shape7       the qwen3-8b shape with row-invariant GEMMs (configs by row count), and without them
#   final        SmolLM2 (none, DFlash) and the qwen3-8b shape (none, oracle) with 128-row exact prefill
# 2026-12-01 (second session), issue 11's table, 4 requests a client:
#   s11          SmolLM2 serving: none, n-gram (indexed, host drafts), DFlash; 5 rounds side by side
#   q11          the qwen3-8b shape: none, the oracle; 3 rounds side by side
#   i11          s11, then q11
#   h11          scripts/bench_http.py (the HTTP server, streamed) for none, n-gram and DFlash on SmolLM2
#   s11b         s11 (steps' times by k), then none and n-gram with the controller off (n-gram drafts 4 each step)
# 2026-12-01 (third session):
#   p12          s11 with 3 rounds, then scripts/profile_serve_loop.py --kernels (graph replays, GPU kernels,
#                host ops) for none at 4 clients and DFlash at 1 and 4 clients
#   r12          s11 with 3 rounds, then profile_serve_loop.py (graph replays, host profile) for DFlash at 4 clients
#   a12          the split attention kernel: scripts/check_split_attention.py (stops here if it fails), the
#                plain loop's graph replays (1 client), then s11 with 3 rounds, then q11
# Prepared for the next session (not run yet):
#   f13          the fused RoPE + KV write: scripts/check_rope_write.py (stops here if a bit differs), then
#                SmolLM2 serving (none, DFlash; 3 rounds) with SPECDEC_FUSED_ROPE=1, then the same with it off
# 2026-12-01 (fourth session), issue 10: the generate path's static steps take the split attention kernel
#   g14c         checks: scripts/check_split_attention.py, the fused RoPE + KV write (check_rope_write.py),
#                device_check.py (random Llama, Qwen3.5 dense and MoE, Gemma 3; spoiled oracle, n-gram, MTP,
#                DFlash; graphs and eager, 8 processes at once) and debug_compile_cuda.py (the custom op compiled)
#   g14b         specdec bench --shape with --contexts: smollm2-135m (graphs; then compiled), qwen3-8b compiled
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
G=/tmp/smollm2.gguf
smollm2() { [ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G; }
q8() {  # name, seconds, bench_serve args...: the qwen3-8b shape (none and the oracle unless told)
    local name=$1 secs=$2; shift 2
    timeout $secs python scripts/bench_serve.py --shape qwen3-8b --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
    echo "$name rc=$?"; grep -E "rror|Traceback" $OUT/$name.log | tail -3; cut -c1-150 $OUT/$name.log; }
serve() {  # name, gpu, seconds, bench_serve args...
    local name=$1 gpu=$2 secs=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout $secs python scripts/bench_serve.py --model $G --json $OUT/$name.json "$@" \
        > $OUT/$name.log 2>&1
    echo "$name rc=$?"; grep -E "rror|Traceback" $OUT/$name.log | tail -3; cut -c1-150 $OUT/$name.log | grep -E "concurrency|repeat"; }
case "${1:-}" in
micro)
    smollm2
    timeout 90 python scripts/micro_kernels.py allreduce --json $OUT/ar_default.json > $OUT/ar_default.log 2>&1
    NCCL_PROTO=LL timeout 60 python scripts/micro_kernels.py allreduce --json $OUT/ar_ll.json > $OUT/ar_ll.log 2>&1
    (serve serve_exact 0 230
     serve serve_noexact 0 170 --no-exact
     CUDA_VISIBLE_DEVICES=0 timeout 90 python -m specdec bench -m $G -n 128 --dataset gsm8k --num-prompts 30 -t 1 \
         --drafts none dflash ngram --compile --json $OUT/t1_gsm8k.json > $OUT/t1.log 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 200 python scripts/micro_kernels.py gemm --sweep --json $OUT/gemm_qwen3_8b.json > $OUT/gemm_qwen3_8b.log 2>&1
     timeout 60 python scripts/micro_kernels.py gemm --shape smollm2-135m --sweep --json $OUT/gemm_smollm2.json \
         > $OUT/gemm_smollm2.log 2>&1) &
    wait ;;
tp)
    b() { local name=$1 secs=$2; shift 2
          timeout $secs python -m specdec bench --reps 5 -n 128 --shape qwen3-8b --compile --json $OUT/$name.json "$@" \
              > $OUT/$name.log 2>&1
          echo "== $name rc=$?"; grep -vE "it/s|^\s*$|Warning|warn" $OUT/$name.log | tail -7 | cut -c1-300; }
    b tp1 170
    b tp2_symm 190 --tensor-parallel 2
    SPECDEC_SYMM_ALLREDUCE=0 b tp2_nccl 190 --tensor-parallel 2 ;;
serve)
    smollm2
    (serve serve_exact_1024 0 200 --context 1024 --no-span-buckets
     serve serve_noexact_1024 0 150 --context 1024 --no-exact) &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 60 python scripts/micro_kernels.py attn > $OUT/attn.log 2>&1
     for r in 1 16; do timeout 120 python scripts/profile_shape_step.py --shape qwen3-8b --rows $r --compile \
         > $OUT/profile_q8_rows$r.log 2>&1; done) &
    wait ;;
determinism)
    smollm2
    d="--context 1024 --drafts none --concurrency 16 --serial 16 --requests 1 --repeat-serial --no-span-buckets"
    serve exact 0 150 $d &
    serve noexact 1 150 $d --no-exact &
    wait
    serve eager 0 150 $d --eager-steps ;;
buckets)
    smollm2
    serve buckets 0 170 --drafts none ngram dflash &
    serve whole 1 170 --drafts ngram dflash --no-span-buckets &
    wait ;;
reuse)
    smollm2
    serve reuse 0 170 --drafts none ngram dflash &
    serve determinism_buckets 1 150 --context 1024 --drafts none --concurrency 16 --serial 16 --requests 1 \
        --repeat-serial &
    wait ;;
slots)
    smollm2
    serve all_slots 0 170 --drafts none dflash &
    serve per_slot 1 170 --drafts none dflash --per-slot-drafters &
    wait ;;
serve1)
    smollm2
    serve per_slot 0 220 --drafts none ngram dflash --per-slot-drafters
    serve all_slots 0 150 --drafts dflash
    for sh in smollm2-135m qwen3-8b; do
        timeout 80 python scripts/check_width_invariance.py --shape $sh --json $OUT/width_$sh.json > $OUT/width_$sh.log 2>&1
        echo "width $sh rc=$?"; tail -3 $OUT/width_$sh.log; done ;;
serve2)
    smollm2
    serve serve2 0 200 --drafts none ngram dflash
    serve serve2_widek0 0 90 --drafts dflash --full-steps  # --wide-k0 at 1a0e304
    serve serve2_per_slot 0 90 --drafts dflash --per-slot-drafters
    q8 shape2_q8 150 ;;
serve3)
    smollm2
    serve serve3 0 200 --drafts none ngram dflash
    serve serve3_full 0 150 --drafts none dflash --full-steps
    q8 shape3_q8 150 ;;
serve4)
    smollm2
    serve serve4 0 200 --drafts none ngram dflash
    serve serve4_full 0 120 --drafts none dflash --full-steps
    for d in none dflash; do
        timeout 90 python scripts/profile_serve_loop.py --model $G --draft $d --json $OUT/prof_$d.json > $OUT/prof_$d.log 2>&1
        echo "prof $d rc=$?"; head -12 $OUT/prof_$d.log; grep -A30 "Ordered by: internal" $OUT/prof_$d.log | cut -c1-160 | head -32; done ;;
serve5)
    smollm2
    serve serve5 0 200 --drafts none ngram dflash
    serve serve5_full 0 120 --drafts none dflash --full-steps
    q8 shape5_q8 150 ;;
serve6)
    smollm2
    q8 shape6_q8 170
    serve serve6 0 200 --drafts none ngram dflash ;;
shape7)
    q8 shape7_q8 200
    q8 shape7_q8_cublas 200 --no-invariant-gemm ;;
final)
    smollm2
    serve final_smollm2 0 100 --drafts none dflash
    q8 final_q8 140 ;;
s11)
    smollm2
    serve s11_smollm2 0 330 --drafts none ngram dflash --requests 4 --rounds 5 ;;
q11)
    q8 q11_q8 300 --requests 4 --rounds 3 ;;
s11b)
    smollm2
    serve s11_smollm2 0 330 --drafts none ngram dflash --requests 4 --rounds 3
    serve s11_noctl 0 200 --drafts none ngram --requests 4 --rounds 2 --no-controller ;;
h11)  # the HTTP server (uvicorn, SSE, detokenisation) under streaming clients, SmolLM2
    smollm2  # the server's packages: wheels carried in .whl/srv (pip download ... --python-version 3.12)
    python -c "import fastapi, uvicorn, httpx, prometheus_client" 2>/dev/null || \
        pip install -q --no-deps --target /tmp/site .whl/srv/*.whl 2>/dev/null
    for d in none ngram dflash; do
        timeout 150 python scripts/bench_http.py --model $G --draft $d --json $OUT/http_$d.json > $OUT/http_$d.log 2>&1
        echo "http $d rc=$?"; grep -E "rror|Traceback" $OUT/http_$d.log | tail -3; cut -c1-200 $OUT/http_$d.log | grep concurrency; done ;;
p12)
    smollm2
    serve s11_smollm2 0 250 --drafts none ngram dflash --requests 4 --rounds 3
    for c in "none 4" "dflash 1" "dflash 4"; do set -- $c
        timeout 120 python scripts/profile_serve_loop.py --model $G --draft $1 --clients $2 -n 128 --kernels --top 45 \
            --json $OUT/prof_$1_c$2.json > $OUT/prof_$1_c$2.log 2>&1
        echo "profile $1 c=$2 rc=$?"; grep -E "rror|Traceback" $OUT/prof_$1_c$2.log | tail -3
        grep -A30 graph_replay_ms $OUT/prof_$1_c$2.log | head -32; done ;;
r12)
    smollm2
    serve s11_smollm2 0 250 --drafts none ngram dflash --requests 4 --rounds 3
    timeout 120 python scripts/profile_serve_loop.py --model $G --draft dflash --clients 4 -n 128 --json $OUT/prof_dflash_c4.json \
        > $OUT/prof_dflash_c4.log 2>&1
    echo "profile rc=$?"; grep -E "rror|Traceback" $OUT/prof_dflash_c4.log | tail -3; grep -E "drafter|step_ms|tokens_per_s" $OUT/prof_dflash_c4.log ;;
a12)
    smollm2
    timeout 200 python scripts/check_split_attention.py --json $OUT/split_check.json > $OUT/split_check.log 2>&1
    rc=$?; echo "check rc=$rc"; tail -4 $OUT/split_check.log | cut -c1-300
    if [ $rc != 0 ] || ! grep -q "failures: 0" $OUT/split_check.log; then
        grep -v '"ok": true' $OUT/split_check.log | head -20 | cut -c1-400
        cd $OUT && tar czf all.tgz *.json *.log; exit 1; fi
    grep times_us -A0 $OUT/split_check.log; grep '"span"' $OUT/split_check.log | cut -c1-200
    timeout 120 python scripts/profile_serve_loop.py --model $G --draft none --clients 1 -n 128 --json $OUT/prof_none_c1.json \
        > $OUT/prof_none_c1.log 2>&1
    echo "profile rc=$?"; grep -A14 graph_replay_ms $OUT/prof_none_c1.log
    serve s11_smollm2 0 250 --drafts none ngram dflash --requests 4 --rounds 3
    q8 q11_q8 300 --requests 4 --rounds 3 ;;
g14c)
    timeout 150 python scripts/check_split_attention.py --json $OUT/split_check.json > $OUT/split_check.log 2>&1
    echo "split check rc=$?"; tail -4 $OUT/split_check.log | cut -c1-250
    timeout 150 python scripts/check_rope_write.py --json $OUT/rope_check.json > $OUT/rope_check.log 2>&1
    echo "rope check rc=$?"; tail -8 $OUT/rope_check.log | cut -c1-250
    D=/tmp/dc; timeout 120 python scripts/device_check.py build $D > $OUT/dc_build.log 2>&1; echo "dc build rc=$?"; tail -2 $OUT/dc_build.log
    for t in llama qwen35 qwen35moe gemma3; do
        for m in graphs eager; do
            dr="oracle ngram mtp dflash"; [ $t = llama ] && dr="oracle ngram dflash"; [ $t = gemma3 ] && dr="oracle ngram"
            timeout 300 python scripts/device_check.py run $D --target $t --mode $m --drafters $dr --out $OUT/dc_${t}_$m.json \
                > $OUT/dc_${t}_$m.log 2>&1 &
        done
    done
    timeout 200 python scripts/debug_compile_cuda.py > $OUT/debug_compile.log 2>&1; echo "debug_compile rc=$?"; tail -5 $OUT/debug_compile.log | cut -c1-250
    wait
    python scripts/device_check.py compare $OUT/dc_*.json --out $OUT/device_check.json 2>&1 | tail -30
    cd $OUT && tar czf all.tgz *.json *.log ;;
g14b)
    sb() { local name=$1 secs=$2; shift 2
           timeout $secs python -m specdec bench --reps 10 -n 128 --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
           echo "== $name rc=$?"; grep -vE "it/s|^\s*$|Warning|warn" $OUT/$name.log | tail -12 | cut -c1-300; }
    sb shape_smollm2 100 --shape smollm2-135m --contexts 128,4096,8000
    sb shape_smollm2_compile 150 --shape smollm2-135m --contexts 128,4096,8000 --compile
    sb shape_qwen3_8b_compile 280 --shape qwen3-8b --contexts 128,4096,16384 --compile
    cd $OUT && tar czf all.tgz *.json *.log ;;
f13)
    smollm2
    timeout 240 python scripts/check_rope_write.py --json $OUT/rope_check.json > $OUT/rope_check.log 2>&1
    rc=$?; echo "check rc=$rc"; cut -c1-250 $OUT/rope_check.log | tail -12
    if [ $rc != 0 ] || ! grep -q "failures: 0" $OUT/rope_check.log; then cd $OUT && tar czf all.tgz *.json *.log; exit 1; fi
    export SPECDEC_FUSED_ROPE=1; serve s13_fused 0 200 --drafts none dflash --requests 4 --rounds 3
    unset SPECDEC_FUSED_ROPE; serve s13_eager 0 200 --drafts none dflash --requests 4 --rounds 3 ;;
i11)
    bash "$0" s11; mv $OUT/all.tgz $OUT/s11.tgz; bash "$0" q11; mv $OUT/all.tgz $OUT/q11.tgz
    tar czf $OUT/all.tgz -C $OUT s11.tgz q11.tgz; rm $OUT/s11.tgz $OUT/q11.tgz; exit ;;
shape)
    q8 shape_q8 330
    q8 shape_q8_noctl 200 --drafts oracle --no-controller ;;
*)
    sed -n "2,/^set -u/p" "$0" | grep "^#"; exit 2 ;;
esac
cd $OUT && tar czf all.tgz *.json *.log 2>/dev/null; rm -f *.json *.log
