#!/bin/bash
# session 6, third round: is the plain serving loop's 1-in-8 difference nondeterminism or batching?
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
G=/tmp/smollm2.gguf
[ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G
(export CUDA_VISIBLE_DEVICES=0
 timeout 150 python scripts/bench_serve.py --model $G --context 1024 --drafts none ngram --concurrency 4 16 32 --serial 16 --requests 1 \
   --repeat-serial --json $OUT/det.json > $OUT/det.log 2>&1; echo "det rc=$?") &
(export CUDA_VISIBLE_DEVICES=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
 timeout 150 python scripts/bench_serve.py --model $G --context 1024 --drafts none --concurrency 4 16 32 --serial 16 --requests 1 \
   --repeat-serial --json $OUT/det_ws.json > $OUT/det_ws.log 2>&1; echo "det_ws rc=$?") &
wait
cd $OUT && tar czf all.tgz *.json *.log 2>/dev/null; rm -f *.json *.log; ls -la $OUT
