# The device runbooks' common start (scripts/device_gather.sh, device_router.sh), sourced as
# `. scripts/device_prelude.sh NAME` from the checkout's root: the GPU's name, the gguf wheel carried in .whl installed
# to /tmp/site, PYTHONPATH, the results folder W=$OUT/NAME, and
#   left T    a step's timeout: T seconds, or what is left of the call's 600 s (LIMIT - SECONDS, LIMIT 570 unless
#             set: a call granted less device time) if less
#   save      $OUT/NAME.tgz from W (what finished survives a time-out)
#   bench S T [args]  specdec bench --shape S at context 512 (the oracle at tau 6.5) within T s, its summary lines
#   ab LABEL SHAPE T VARIANTS...  scripts/ab_flags.py's variants in one process (context 512, no drafters)
#   ox LABEL SHAPE T VARIANTS...  scripts/check_oracle_exact.py (plain, then the oracle at k = 15: equal?)
#   dc        scripts/device_check.py on random Qwen3.5 dense and MoE (graphs: oracle, n-gram, MTP, DFlash drafts; MoE
#             eager: oracle, MTP), then its comparison
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
NAME=$1
W=$OUT/$NAME; mkdir -p $W
left() { echo $(( ${1} < ${LIMIT:-570} - SECONDS ? ${1} : ${LIMIT:-570} - SECONDS )); }
save() { (cd $OUT && tar czf $NAME.tgz $NAME); }
bench() {
    local name=$1 t=$2; shift 2
    [ "$(left $t)" -lt 30 ] && { echo "== $name skipped (${SECONDS}s)"; return; }
    timeout $(left $t) python -m specdec bench --shape $name --context 512 --oracle-tau 6.5 --json $W/b_$name.json \
        "$@" > $W/b_$name.log 2>&1
    echo "== $name rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_$name.log | tail -9 | cut -c1-240; save
}
ab() {  # LABEL SHAPE TIMEOUT VARIANTS...: ab_flags at context 512, the variants in one process
    local label=$1 shape=$2 t=$3; shift 3
    timeout $(left $t) python scripts/ab_flags.py --shape $shape \
        --context 512 --rounds 3 --reps 10 --no-drafters --variants "$@" --json $W/ab_$label.json > $W/ab_$label.log 2>&1
    echo "== ab $label rc=$? ${SECONDS}s"; grep -v "^round" $W/ab_$label.log | tail -8 | cut -c1-300; save
}
ox() {  # LABEL SHAPE TIMEOUT VARIANTS...: check_oracle_exact.py (plain, then the oracle at tau 6.5, k = 15; equal?)
    local label=$1 shape=$2 t=$3; shift 3
    timeout $(left $t) python scripts/check_oracle_exact.py --shape $shape -n 256 --variants "$@" \
        --json $W/ox_$label.json > $W/ox_$label.log 2>&1
    echo "== oracle $label rc=$? ${SECONDS}s"; tail -2 $W/ox_$label.log | cut -c1-300; save
}
dc() {  # device_check (graphs and eager) on random Qwen3.5 dense and MoE, then the comparison
    timeout $(left 120) python scripts/device_check.py build /tmp/dc > $W/dc_build.log 2>&1
    for t in qwen35 qwen35moe; do
        timeout $(left 70) python scripts/device_check.py run /tmp/dc --target $t --mode graphs \
            --drafters oracle ngram mtp dflash --prompts 4 --new-tokens 128 --out $W/dc_$t.json > $W/dc_$t.log 2>&1 \
            || echo "dc $t rc=$?"
    done
    timeout $(left 70) python scripts/device_check.py run /tmp/dc --target qwen35moe --mode eager --drafters oracle mtp \
        --prompts 2 --new-tokens 64 --out $W/dc_qwen35moe_eager.json > $W/dc_qwen35moe_eager.log 2>&1 || echo "dc eager rc=$?"
    python scripts/device_check.py compare $W/dc_*.json --out $W/dc_report.json 2>&1 | tail -14; echo "== dc ${SECONDS}s"; save
}
