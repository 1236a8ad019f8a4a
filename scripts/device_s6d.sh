#!/bin/bash
# session 6, fourth round: where does the plain serving loop's run-to-run difference come from?
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
G=/tmp/smollm2.gguf
[ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G
r() { local name=$1 gpu=$2; shift 2
      CUDA_VISIBLE_DEVICES=$gpu timeout 150 python scripts/bench_serve.py --model $G --context 1024 --drafts none --concurrency 16 \
        --serial 16 --requests 1 --repeat-serial "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; cut -c1-200 $OUT/$name.log; }
r exact 0 &
r noexact 1 --no-exact &
wait
r eager 0 --eager-steps
cd $OUT && tar czf all.tgz *.log 2>/dev/null; rm -f *.log
