#!/bin/bash
# A MoE layer's post-mixer add and norm with the router's GEMM in one kernel (expert_kernel.NORM_ROUTER) against the
# norm kernel then the router's GEMM; one device call each (carry .whl):
#   bash scripts/device_router.sh check  # check_norm_router.py (bits against the norm kernel, a row alone and among
#                                        # others, the two forms' time) on the qwen3.5-35b-a3b shape's sizes; ab_flags
#                                        # defaults / defaults-norm-router on that shape (padded 16-row and 1-row steps;
#                                        # --no-drafters: its random drafters beside it ran an 80 GB card out of memory);
#                                        # device_check on random Qwen3.5 MoE, Gemma 4 and Gemma 4 E (graphs; oracle,
#                                        # n-gram, MTP and DFlash drafts where they fit; the kernel on)
#   bash scripts/device_router.sh bench  # the 35b shape's 1-row step's kernels (profile_shape_step.py --timeline);
#                                        # specdec bench --shape qwen3.5-35b-a3b, qwen3-8b, qwen3.5-9b, smollm2-135m
#   bash scripts/device_router.sh once   # where one call is all there is: check_norm_router, ab_flags, device_check
#                                        # on random Qwen3.5 MoE (the kernel on), the 35b shape's bench with and without
#                                        # the kernel, then qwen3-8b's, as the call's time allows
# Results in $OUT/r.tgz.
set -u
. scripts/device_prelude.sh r  # W=$OUT/r, left, save, bench
check_ab() {  # AB_TIMEOUT: check_norm_router.py, then ab_flags on the 35b shape with the kernel and without
    timeout $(left 60) python scripts/check_norm_router.py --json $W/check_35b.json > $W/check_35b.log 2>&1
    echo "== check rc=$? ${SECONDS}s"; cat $W/check_35b.log | tr -d '\n' | cut -c1-900; echo; save
    timeout $(left $1) python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --reps 10 \
        --no-drafters --variants defaults defaults-norm-router --json $W/ab_35b.json > $W/ab_35b.log 2>&1
    echo "== ab rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_35b.log | tail -4 | cut -c1-300; save
}
dc() {  # BUILD_TIMEOUT TARGET...: device_check (graphs, the kernel on) on each random target, then the comparison
    local t0=$1; shift
    timeout $(left $t0) python scripts/device_check.py build /tmp/dc > $W/dc_build.log 2>&1
    for t in "$@"; do
        SPECDEC_NORM_ROUTER=1 timeout $(left 70) python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --drafters oracle ngram mtp dflash --prompts 4 --new-tokens 128 --out $W/dc_$t.json > $W/dc_$t.log 2>&1 \
            || echo "dc $t rc=$?"
    done
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -14; echo "== dc ${SECONDS}s"; save
}
case "${1:-}" in
check)
    check_ab 240
    dc 120 qwen35moe gemma4 gemma4e ;;
bench)
    timeout $(left 150) python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --rows 1 --context 512 --top 14 \
        --timeline $W/tl35.json > $W/prof35.log 2>&1
    echo "== profile rc=$? ${SECONDS}s $(grep -m1 captured_ms $W/prof35.log)"; save
    bench qwen3.5-35b-a3b 150 --draft-vocab 32768 --reps 10
    bench qwen3-8b 130 --draft-vocab 32768 --reps 10
    bench qwen3.5-9b 110 --draft-vocab 32768 --reps 10
    bench smollm2-135m 50 ;;
once)
    check_ab 200
    dc 100 qwen35moe
    for v in 1 0; do
        [ "$(left 150)" -lt 60 ] && break
        SPECDEC_NORM_ROUTER=$v timeout $(left 150) python -m specdec bench --shape qwen3.5-35b-a3b --context 512 \
            --oracle-tau 6.5 --draft-vocab 32768 --reps 10 --json $W/b_35b_nr$v.json > $W/b_35b_nr$v.log 2>&1
        echo "== bench 35b NORM_ROUTER=$v rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_35b_nr$v.log | tail -9 | cut -c1-240; save
    done
    bench qwen3-8b 130 --draft-vocab 32768 --reps 10 ;;
*)
    echo "usage: bash scripts/device_router.sh check | bench | once"; exit 2 ;;
esac
save && rm -rf $W
