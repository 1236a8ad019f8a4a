#!/bin/bash
# The Gated DeltaNet step's recurrence, output norm and out_proj as one persistent kernel (delta_kernel.TAIL), checked
# and timed on the GPU; one device call each:
#   bash scripts/device_tail.sh check  # check_oracle_exact.py (the bench's oracle, k = 15) on qwen3.5-35b-a3b for the
#                                      # defaults and the tail's three forms (tau, equal to plain, barrier timeouts,
#                                      # registers); ab_flags on the 35b shape (padded, 1-row and chained steps);
#                                      # device_check with SPECDEC_DELTA_TAIL=1 on random Qwen3.5 dense and MoE
#   bash scripts/device_tail.sh bench  # specdec bench --shape qwen3.5-35b-a3b, without and with SPECDEC_DELTA_TAIL=1
# Results in $OUT/t.tgz.
set -u
. scripts/device_prelude.sh t  # W=$OUT/t, left, save, bench
TAILS="defaults+delta-tail defaults+delta-tail+tail16 defaults+delta-tail+tail-l2"
case "${1:-}" in
check)
    timeout $(left 150) python scripts/check_oracle_exact.py --shape qwen3.5-35b-a3b -n 256 --variants defaults $TAILS \
        --json $W/ox_35b.json > $W/ox_35b.log 2>&1
    echo "== oracle rc=$? ${SECONDS}s"; grep "^{" $W/ox_35b.log | cut -c1-400; tail -3 $W/ox_35b.log | cut -c1-300; save
    timeout $(left 170) python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --reps 10 \
        --no-drafters --variants defaults $TAILS --json $W/ab_35b.json > $W/ab_35b.log 2>&1
    echo "== ab rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_35b.log | tail -6 | cut -c1-300; save
    timeout $(left 100) python scripts/device_check.py build /tmp/dc > $W/dc_build.log 2>&1
    for t in qwen35 qwen35moe; do
        SPECDEC_DELTA_TAIL=1 timeout $(left 60) python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --drafters oracle ngram mtp --prompts 4 --new-tokens 96 --out $W/dc_$t.json > $W/dc_$t.log 2>&1 \
            || echo "dc $t rc=$?"
    done
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -10; echo "== dc ${SECONDS}s" ;;
bench)
    bench qwen3.5-35b-a3b 190 --draft-vocab 32768 --reps 10
    mv $W/b_qwen3.5-35b-a3b.json $W/b_35b_off.json; mv $W/b_qwen3.5-35b-a3b.log $W/b_35b_off.log
    SPECDEC_DELTA_TAIL=1 bench qwen3.5-35b-a3b 190 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_tail.sh check | bench"; exit 2 ;;
esac
save && rm -rf $W
