#!/bin/bash
# session 6, fifth round: the serving loop with span buckets (default on CUDA) against the whole
# context (--no-span-buckets), side by side on the two GPUs; the SmolLM2 GGUF at /tmp/smollm2.gguf
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
G=/tmp/smollm2.gguf
[ -f $G ] || cat /tmp/part1 .dev/b/part2 > $G
r() { local name=$1 gpu=$2; shift 2
      CUDA_VISIBLE_DEVICES=$gpu timeout 170 python scripts/bench_serve.py --model $G --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1
      echo "$name rc=$?"; grep -E "rror|Traceback" $OUT/$name.log | tail -3; cut -c1-150 $OUT/$name.log | grep concurrency; }
r buckets 0 --drafts none ngram dflash &
r whole 1 --drafts ngram dflash --no-span-buckets &
wait
cd $OUT && tar czf all.tgz *.json *.log 2>/dev/null; rm -f *.json *.log
