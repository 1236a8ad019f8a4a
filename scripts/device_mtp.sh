#!/bin/bash
# Session of 2026-12-06 (sixth), issue 10 follow-ups on the device machine:
#   bash scripts/device_mtp.sh probe    # after device_stage.sh part1 and join (the tree with the shipped drafters):
#                                       # scripts/probe_mtp_bench.py on the real SmolLM2: `specdec bench` (GSM8K 40, -n 128,
#                                       # k 3) with MTP alone, then among the four drafters; again in a second process;
#                                       # then alone with a cold Triton cache of its own; every propose timed (call 3 of
#                                       # the session, at 39fe172, ran B and C with SPECDEC_MTP_CATCHUP, removed since)
#   bash scripts/device_mtp.sh rope     # SPECDEC_ROPE_TABLE: static_cos_sin's bits against cos_sin on CUDA (4 rotaries,
#                                       # bf16, 40,000 positions); ab_flags without / with it on smollm2-135m at 300
#                                       # (drafters' proposes too) and qwen3-8b at 512; device_check with it (random Llama
#                                       # and Qwen3.5 MoE, graphs; oracle and MTP drafts). Call 1 ran it at 39fe172, the
#                                       # table off by default then (variants defaults / defaults+rope-table)
#   bash scripts/device_mtp.sh oracle   # bench --shape qwen3-8b -n 512 with the oracle's low-discrepancy cuts (764d9d9)
#   bash scripts/device_mtp.sh split    # after part1 and join (the tree with the shipped drafters): probe_mtp_bench on the
#                                       # real SmolLM2, MTP alone without / with SPECDEC_MTP_SPLIT_CATCHUP, twice each in one
#                                       # process (session of 2026-12-06 (seventh))
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl) for probe.
set -u
case "${1:-}" in probe|rope|oracle|split) ;; *) echo "device_mtp.sh: probe | rope | oracle | split"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "$1" in probe|split)
    [ -s /tmp/smol.gguf ] || { echo "device_mtp.sh $1: no /tmp/smol.gguf (run device_stage.sh part1 and join)"; exit 2; } ;;
esac
case "$1" in
split)
    timeout 420 python scripts/probe_mtp_bench.py --model /tmp/smol.gguf --num-prompts 40 -n 128 \
        --runs alone,alone+split,alone,alone+split --json $R/split.json > $R/split.log 2>&1
    echo "== split rc=$?"; grep -E "^\{|Error" $R/split.log | cut -c1-900 ;;
probe)
    # A and B: two processes, the Triton cache as the machine has it; C: a cold cache of its own
    p() {  # NAME TIMEOUT RUNS
        timeout $2 python scripts/probe_mtp_bench.py --model /tmp/smol.gguf --num-prompts 40 -n 128 --runs $3 \
            --json $R/probe_$1.json > $R/probe_$1.log 2>&1
        echo "== $1 rc=$?"; grep -E "^\{|Error" $R/probe_$1.log | cut -c1-700
    }
    p A 150 alone,four
    p B 120 four,alone
    export TRITON_CACHE_DIR=/tmp/tc_cold; p C 100 alone ;;
rope)
    python - <<'PY' 2>&1 | tee $R/rope_bits.log
import torch
from specdec.models import layers
from specdec.models.layers import RotaryEmbedding
layers.ROPE_TABLE = True
cases = {"default": dict(head_dim=128, theta=1e6), "partial": dict(head_dim=256, theta=1e7, partial_factor=0.25),
         "llama3": dict(head_dim=64, theta=5e5, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
         "smollm2": dict(head_dim=64, theta=1e5)}
bad = 0
for name, kw in cases.items():
    r = RotaryEmbedding(**kw)
    for start in range(0, 40000, 997):
        for t in (1, 4, 16):
            pos = torch.arange(start, start + t, device="cuda")
            a, b = layers.static_cos_sin(r, pos, torch.bfloat16, 40016), r.cos_sin(pos, torch.bfloat16)
            bad += not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
print("rope table: (rotary, start, rows) cases differing from cos_sin:", bad)
PY
    ab() {  # NAME TIMEOUT CONTEXT ab_flags args...
        local name=$1 t=$2 c=$3; shift 3
        timeout $t python scripts/ab_flags.py --context $c --json $R/ab_$name.json "$@" > $R/ab_$name.log 2>&1
        echo "== $name rc=$?"; grep -E "^\||Error" $R/ab_$name.log | cut -c1-200
    }
    ab smollm2_300 110 300 --shape smollm2-135m --rounds 3 --variants defaults-rope-table defaults
    ab 8b_512 100 512 --shape qwen3-8b --rounds 2 --no-drafters --variants defaults-rope-table defaults
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for t in llama qwen35moe; do
        d="oracle"; [ $t != llama ] && d="oracle mtp"
        timeout 60 python scripts/device_check.py run /tmp/dc --target $t --mode graphs --drafters $d \
            --prompts 4 --new-tokens 128 --out $R/dc_${t}.json > $R/dc_${t}.log 2>&1 || echo "$t rc=$?"
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -8 ;;
oracle)
    timeout 300 python -m specdec bench --shape qwen3-8b --context 512 -n 512 --oracle-tau 6.5 --draft-vocab 32768 \
        --reps 5 --json $R/b8b_n512.json > $R/b8b_n512.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b8b_n512.log | tail -4 | cut -c1-260 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
