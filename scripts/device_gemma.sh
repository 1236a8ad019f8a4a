#!/bin/bash
# Gemma on the H200 (BENCHMARKS.md, issue 12), one device call of < 10 min:
# - gemma-3-270m (Q4_K_M GGUF, 253 MB, base model: raw prompts) plain against n-gram;
# - a random gemma4-26b-a4b-shape target: step costs and an oracle drafter (tau 6.5).
# The GGUF travels first in five pieces of < 51 MB (calls carrying .dev/gN, each copied to /tmp/gN);
# this script joins them and checks the package's SHA-256.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/gemma-3-270m-q4_k_m.gguf
[ -f $G ] || cat /tmp/g1/* /tmp/g2/* /tmp/g3/* /tmp/g4/* /tmp/g5/* > $G
echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $G" | sha256sum -c || exit 1
[ -d /tmp/site/gguf ] || pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl 2>/dev/null
for ds in gsm8k humaneval; do
    timeout 150 python -m specdec bench -m $G -n 128 --no-chat --dataset $ds --num-prompts ${N:-40} \
        --drafts none ngram --json $OUT/gemma3_270m_$ds.json > /tmp/g_$ds.log 2>&1
    echo "== gemma3 $ds rc=$?"; grep -E "^\||^machine|rror" /tmp/g_$ds.log | tail -8
done
timeout 200 python -m specdec bench --shape gemma4-26b-a4b --reps ${R:-10} -n 128 --json $OUT/shape_gemma4_26b_a4b.json \
    > /tmp/g4.log 2>&1
echo "== gemma4-26b-a4b shape rc=$?"; grep -vE "it/s|^\s*$|Warning|warn" /tmp/g4.log | tail -14 | cut -c1-400
