#!/bin/bash
# Nsight Compute on a static step, the A/B of the persistent MoE combine (expert_kernel.COMBINE_STREAM, off until
# measured), and the checks of the gated attention's gate in the split kernel (layers.GATE_IN_SPLIT); one device call each:
#   bash scripts/device_ncu.sh ncu [ROWS...]  # in this order: (an H200) bench --shape qwen3-8b; ab_flags on the
#                                             # 35b shape: defaults against the routing kernel on 1 warp, the
#                                             # persistent MoE combine on its default tiling and on 2 channels a
#                                             # block, the one-shot combine on 256-wide blocks; check_oracle_exact
#                                             # (k = 15) on the 35b with the persistent combine; ncu on one static
#                                             # step of the 35b's first 4 layers (scripts/ncu_step.py; default 1
#                                             # row); dc: device_check on random Qwen3.5 dense and MoE, drafts accepted
#   bash scripts/device_ncu.sh stream         # ab_flags on the 35b shape: defaults against defaults+combine-stream
#   bash scripts/device_ncu.sh gate           # ab_flags on the 35b shape (defaults against defaults-gate-split);
#                                             # specdec bench --shape qwen3.5-35b-a3b (its oracle's output checked
#                                             # against plain decoding's); check_oracle_exact (k = 15) on qwen3.5-9b;
#                                             # its bench as time allows (LIMIT=S: a call granted S seconds)
# (device_delta.sh check | bench: the full device_check and the Qwen3.5 shapes' bench)
# Results in $OUT/n.tgz: ncu_rN.ncu-rep (open with `ncu --import`), ncu_rN.csv (the sections' details),
# ncu_rN_raw.csv (every metric, a row a kernel; scripts/ncu_summary.py ncu_rN.csv: a table), dc_*, ab_*, ox_*, b_*.
set -u
. scripts/device_prelude.sh n  # W=$OUT/n, left, save, bench, ab, ox, dc
case "${1:-}" in
ncu)
    shift
    # on an H200 first the qwen3-8b shape's bench (issue 10's oracle target is the H200's; none came in five sessions)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && bench qwen3-8b 200 --draft-vocab 32768 --draft-int8 --reps 10
    export AB_STREAM=2,4,2
    ab 35b qwen3.5-35b-a3b 230 defaults defaults+route-w1 defaults+combine-stream defaults+stream-tile \
        defaults+combine-bk256
    ox 35b qwen3.5-35b-a3b 120 defaults+combine-stream  # the persistent combine's output: plain's, drafts accepted?
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    $NCU --version | tail -1
    for rows in ${@:-1}; do
        timeout $(left 150) $NCU --profile-from-start off --clock-control none --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
            -o $W/ncu_r$rows python scripts/ncu_step.py --shape qwen3.5-35b-a3b --layers 4 --rows $rows \
            > $W/ncu_r$rows.log 2>&1
        echo "== ncu rows $rows rc=$? ${SECONDS}s"; tail -2 $W/ncu_r$rows.log | cut -c1-200
        $NCU --import $W/ncu_r$rows.ncu-rep --csv --page details > $W/ncu_r$rows.csv 2>/dev/null
        $NCU --import $W/ncu_r$rows.ncu-rep --csv --page raw > $W/ncu_r${rows}_raw.csv 2>/dev/null
        save
    done
    dc ;;
stream)  # a short call: the persistent combine against the defaults only
    ab 35b qwen3.5-35b-a3b 200 defaults defaults+combine-stream ;;
gate)
    ab 35b qwen3.5-35b-a3b 130 defaults defaults-gate-split
    bench qwen3.5-35b-a3b 170 --draft-vocab 32768 --reps 10
    ox 9b qwen3.5-9b 80 defaults
    bench qwen3.5-9b 110 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_ncu.sh ncu [ROWS...] | stream | gate"; exit 2 ;;
esac
save && rm -rf $W
