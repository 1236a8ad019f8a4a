#!/bin/bash
# session-6 measurements on nvidia-h200-x2 (one call, < 10 min); the SmolLM2 GGUF at /tmp/smollm2.gguf
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
G=/tmp/smollm2.gguf
[ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G 2>/dev/null
ls -la $G
[ "${AR:-1}" = 1 ] && timeout 90 python scripts/micro_kernels.py allreduce --json $OUT/ar_default.json > $OUT/ar_default.log 2>&1; echo "ar rc=$?"
[ "${AR:-1}" = 1 ] && NCCL_PROTO=LL timeout 60 python scripts/micro_kernels.py allreduce --json $OUT/ar_ll.json > $OUT/ar_ll.log 2>&1; echo "ar_ll rc=$?"
tail -5 $OUT/ar_default.log
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 230 python scripts/bench_serve.py --model $G --json $OUT/serve_exact.json > $OUT/serve_exact.log 2>&1; echo "serve_exact rc=$?"
  timeout 170 python scripts/bench_serve.py --model $G --no-exact --json $OUT/serve_noexact.json > $OUT/serve_noexact.log 2>&1; echo "serve_noexact rc=$?"
  timeout 90 python -m specdec bench -m $G -n 128 --dataset gsm8k --num-prompts 30 -t 1 --drafts none dflash ngram --compile \
    --json $OUT/t1_gsm8k.json > $OUT/t1.log 2>&1; echo "t1 rc=$?"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python scripts/micro_kernels.py gemm --sweep --json $OUT/gemm_qwen3_8b.json > $OUT/gemm_qwen3_8b.log 2>&1; echo "gemm rc=$?"
  timeout 60 python scripts/micro_kernels.py gemm --shape smollm2-135m --sweep --json $OUT/gemm_smollm2.json > $OUT/gemm_smollm2.log 2>&1
  rm -rf /tmp/flat && mkdir /tmp/flat && cp -r specdec /tmp/flat/ && (cd /tmp/flat && patch -p1 < $OLDPWD/moeflat.patch) > /dev/null
  for s in ${FLAT-gemma4-26b-a4b qwen3.5-35b-a3b}; do
    (cd /tmp/flat && PYTHONPATH=/tmp/site:/tmp/flat timeout 150 python -m specdec bench --shape $s --reps 3 -n 32 \
      --json $OUT/flat_$s.json > $OUT/flat_$s.log 2>&1; echo "flat $s rc=$?")
  done
) &
wait
cd $OUT && tar czf all.tgz *.json *.log && rm -f *.json *.log; ls -la $OUT
