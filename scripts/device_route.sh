#!/bin/bash
# Session of 2026-12-06 (eighth), issue 10: SPECDEC_ROUTER_ROUTES (a MoE block's router GEMV and its routing as one
# kernel, expert_kernel._router_kernel) on the device machine, in one call:
#   bash scripts/device_route.sh ab     # a row's bits alone and beside 15 others (1..16 rows, the flag on);
#                                       # ab_flags on qwen3.5-35b-a3b at 512 (defaults / defaults+router, 3 rounds);
#                                       # device_check with it on (random Qwen3.5 MoE, graphs; oracle, MTP); the MoE
#                                       # block alone without / with it (sweep_moe_kernel --defaults-only, us a layer)
#   bash scripts/device_route.sh bench  # bench --shape qwen3.5-35b-a3b without / with it (plain tok/s, MTP K=3 ratio)
#   bash scripts/device_route.sh all    # on an H200: device_h200.sh a first (its results in $OUT/h200a.tgz), then ab
#                                       # without the block sweeps; on another card: ab, then the bench with it on
#   bash scripts/device_route.sh timeline  # the 35b step's timeline (profile_shape_step.py) without / with it, 1 and 4
#                                       # rows: each MoE kernel's share of the step
#   bash scripts/device_route.sh last   # on an H200: device_h200.sh a; on another card: the timeline, 60 s a run
# Results in $OUT/r.tgz. Needs the gguf wheel (carry .whl); no checkpoint.
set -u
case "${1:-}" in ab|bench|all|timeline|last) ;; *) echo "device_route.sh: ab | bench | all | timeline | last"; exit 2 ;; esac
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/scripts PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
h200=0; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && h200=1
ab() {  # SWEEPS (1: the block alone too)
    SPECDEC_ROUTER_ROUTES=1 python - <<'PY' 2>&1 | tee $R/bits.log
import torch
from specdec.models import expert_kernel as ek
from specdec.models.moe import SparseMoeBlock
from specdec.shapes import shape_config
_, c = shape_config("qwen3.5-35b-a3b")
torch.manual_seed(0)
with torch.inference_mode():
    b = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.num_experts,
                       c.num_experts_per_tok).to("cuda", torch.bfloat16)
    for p in b.parameters():
        p.normal_(0, 0.02)
    b.shared_expert.fuse(); b.fuse()
    x = torch.randn(16, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([b(x[i:i + 1]) for i in range(16)])
    bad = sum(not torch.equal(b(x[:n]), alone[:n]) for n in range(1, 17))
    live = b(x, torch.tensor(3, device="cuda"))
    same = 0
    for n in (1, 4, 16):
        for rep in range(20):
            xs = torch.randn(n, c.hidden_size, device="cuda", dtype=torch.bfloat16)
            ek.ROUTER_ROUTES = True
            a = b(xs)
            ek.ROUTER_ROUTES = False
            same += torch.equal(a, b(xs))
print("router routes: row counts 1..16 whose rows differ from the rows alone:", bad,
      "| live 3 of 16: live rows equal, padding zero:", torch.equal(live[:3], alone[:3]) and not live[3:].any(),
      "| outputs equal with it off (60 cases of 1/4/16 rows):", same)
PY
    timeout 240 python scripts/ab_flags.py --shape qwen3.5-35b-a3b --context 512 --rounds 3 --no-drafters \
        --variants defaults defaults+router --json $R/ab_35b.json > $R/ab_35b.log 2>&1
    echo "== ab rc=$?"; grep -E "^\||Error" $R/ab_35b.log | cut -c1-200
    python scripts/device_check.py build /tmp/dc > /dev/null 2>&1
    for m in graphs; do
        # (the random MoE's router on the 35b's tiling: K split 8 ways)
        SPECDEC_ROUTER_ROUTES=1 SPECDEC_FUSED_LAYER_TILES='{"65,1024,0": [16, 128, 2, 3, 8]}' \
            timeout 90 python scripts/device_check.py run /tmp/dc --target qwen35moe --mode $m \
            --drafters oracle mtp --prompts 4 --new-tokens 128 --out $R/dc_$m.json > $R/dc_$m.log 2>&1 || echo "$m rc=$?"
    done
    python scripts/device_check.py compare $R/dc_*.json --out $R/dc_report.json 2>&1 | tail -8
    [ "$1" = 1 ] || return 0
    for v in 0 1; do
        SPECDEC_ROUTER_ROUTES=$v timeout 80 python scripts/sweep_moe_kernel.py --defaults-only --json $R/moe_$v.json \
            > $R/moe_$v.log 2>&1
        echo "== block, router routes $v rc=$?"; grep fused $R/moe_$v.log
    done
}
bench() {  # TIMEOUT V...: bench --shape qwen3.5-35b-a3b with SPECDEC_ROUTER_ROUTES=V
    local t=$1; shift
    for v in "$@"; do
        SPECDEC_ROUTER_ROUTES=$v timeout $t python -m specdec bench --shape qwen3.5-35b-a3b --context 512 \
            --oracle-tau 6.5 --draft-vocab 32768 --reps 10 --json $R/b35_$v.json > $R/b35_$v.log 2>&1
        echo "== bench, router routes $v rc=$?"; grep -vE "^ *(verify|k=)" $R/b35_$v.log | tail -8 | cut -c1-260
    done
}
timeline() {  # TIMEOUT: each run's
    for rv in 1,0 1,1 4,1 4,0; do
        rows=${rv%,*} v=${rv#*,}
        SPECDEC_ROUTER_ROUTES=$v timeout $1 python scripts/profile_shape_step.py --shape qwen3.5-35b-a3b --context 512 \
            --rows $rows --timeline $R/tl_${v}_$rows.json > $R/prof_${v}_$rows.json 2> $R/prof_${v}_$rows.err
        echo "== router routes $v, $rows rows rc=$?"
        [ -s $R/tl_${v}_$rows.json ] && summary $R/tl_${v}_$rows.json
    done
}
summary() {  # TIMELINE.json...
    python - "$@" <<'PY'
import collections, json, os, sys
for f in sys.argv[1:]:
    tl = json.load(open(f))
    added, count = collections.Counter(), collections.Counter()
    for name, start, dur, add in tl:
        key = name if name.startswith("_") else "torch"
        added[key] += add
        count[key] += 1
    span = tl[-1][1] + tl[-1][2] - tl[0][1]
    # a MoE block's routing: the router GEMM (the _kernel before _route_kernel) + _route_kernel, or _router_kernel;
    # then what the gate/up kernel after it adds
    route = [tl[i - 1][3] + e[3] for i, e in enumerate(tl) if e[0] == "_route_kernel"] or \
        [e[3] for e in tl if e[0] == "_router_kernel"]
    print(os.path.basename(f), "span %.1f us, %d kernels; routing %.2f us a layer (%d);" % (
        span, len(tl), sum(route) / max(len(route), 1), len(route)),
          "; ".join("%s %d x %.2f" % (k, count[k], added[k] / count[k]) for k in sorted(added) if count[k] >= 10))
PY
}
case "$1" in
timeline) timeline 110 ;;
last)
    if [ $h200 = 1 ]; then bash scripts/device_h200.sh a; mv $OUT/r.tgz $OUT/h200a.tgz; mkdir -p $R; else timeline 60; fi
    ;;
ab) ab 1 ;;
bench) bench 250 0 1 ;;
all)
    if [ $h200 = 1 ]; then
        (bash scripts/device_h200.sh a; mv $OUT/r.tgz $OUT/h200a.tgz); mkdir -p $R
        ab 0
    else
        ab 0; bench 200 1
    fi ;;
esac
cd $OUT && tar czf r.tgz r && rm -rf r
