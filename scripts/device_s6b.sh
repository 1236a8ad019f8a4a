#!/bin/bash
# session-6 measurements, second round (nvidia-h200-x2); results tarred into $OUT/all.tgz
#   bash scripts/device_s6b.sh tp      # TP=1, TP=2 with symmetric-memory all-reduce, TP=2 with NCCL only
#   bash scripts/device_s6b.sh serve   # needs /tmp/smollm2.gguf: serving at context 1024, step profiles, SDPA span check
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
G=/tmp/smollm2.gguf
case "$1" in
tp)
    b() { local name=$1 secs=$2; shift 2
          timeout $secs python -m specdec bench --reps 5 -n 128 --shape qwen3-8b --compile --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
          echo "== $name rc=$?"; grep -vE "it/s|^\s*$|Warning|warn" $OUT/$name.log | tail -7 | cut -c1-300; }
    b tp1 170
    b tp2_symm 190 --tensor-parallel 2
    SPECDEC_SYMM_ALLREDUCE=0 b tp2_nccl 190 --tensor-parallel 2 ;;
serve)
    [ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 python scripts/bench_serve.py --model $G --context 1024 --json $OUT/serve_exact_1024.json > $OUT/serve_exact_1024.log 2>&1; echo "serve exact rc=$?"
     timeout 150 python scripts/bench_serve.py --model $G --context 1024 --no-exact --json $OUT/serve_noexact_1024.json > $OUT/serve_noexact_1024.log 2>&1; echo "serve noexact rc=$?") &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 60 python scripts/micro_kernels.py attn > $OUT/attn.log 2>&1; echo "attn rc=$?"
     for r in 1 16; do timeout 120 python scripts/profile_shape_step.py --shape qwen3-8b --rows $r --compile > $OUT/profile_q8_rows$r.log 2>&1; echo "profile $r rc=$?"; done) &
    wait ;;
esac
cd $OUT && tar czf all.tgz *.json *.log 2>/dev/null; rm -f *.json *.log; ls -la $OUT
