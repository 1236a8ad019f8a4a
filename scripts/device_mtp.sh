#!/bin/bash
# Session of 2026-12-06 (sixth), issue 10 follow-ups on the device machine:
#   bash scripts/device_mtp.sh probe    # after device_stage.sh part1 and join (the tree with the shipped drafters):
#                                       # scripts/probe_mtp_bench.py on the real SmolLM2: `specdec bench` (GSM8K 40, -n 128,
#                                       # k 3) with MTP alone, among the four drafters, alone again (a cold Triton cache);
#                                       # then among the four with SPECDEC_MTP_CATCHUP off / on alternated; then the catch-up
#                                       # first with a cold Triton cache of its own; every propose timed
#   bash scripts/device_mtp.sh oracle   # bench --shape qwen3-8b -n 512 with the oracle's low-discrepancy cuts (764d9d9)
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl) for probe.
set -u
case "${1:-}" in probe|oracle) ;; *) echo "device_mtp.sh: probe | oracle"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "$1" in
probe)
    [ -s /tmp/smol.gguf ] || { echo "device_mtp.sh probe: no /tmp/smol.gguf (run device_stage.sh part1 and join)"; exit 2; }
    # A: a cold Triton cache (a fresh machine); B: alternated, steady; C: the catch-up first, a cold cache of its own
    p() {  # NAME TIMEOUT RUNS
        timeout $2 python scripts/probe_mtp_bench.py --model /tmp/smol.gguf --num-prompts 40 -n 128 --runs $3 \
            --json $R/probe_$1.json > $R/probe_$1.log 2>&1
        echo "== $1 rc=$?"; grep -E "^\{|Error" $R/probe_$1.log | cut -c1-700
    }
    p A 150 alone,four,alone
    p B 200 four,four+catchup,four,four+catchup
    export TRITON_CACHE_DIR=/tmp/tc_cold; p C 120 alone+catchup,alone ;;
oracle)
    timeout 300 python -m specdec bench --shape qwen3-8b --context 512 -n 512 --oracle-tau 6.5 --draft-vocab 32768 \
        --reps 5 --json $R/b8b_n512.json > $R/b8b_n512.log 2>&1
    echo "== bench rc=$?"; grep -vE "^ *(verify|k=)" $R/b8b_n512.log | tail -4 | cut -c1-260 ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
