# The device runbooks' common start (scripts/device_gather.sh, device_router.sh), sourced as
# `. scripts/device_prelude.sh NAME` from the checkout's root: the GPU's name, the gguf wheel carried in .whl installed
# to /tmp/site, PYTHONPATH, the results folder W=$OUT/NAME, and
#   left T    a step's timeout: T seconds, or what is left of the call's 600 s (570 - SECONDS) if less
#   save      $OUT/NAME.tgz from W (what finished survives a time-out)
#   bench S T [args]  specdec bench --shape S at context 512 (the oracle at tau 6.5) within T s, its summary lines
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
NAME=$1
W=$OUT/$NAME; mkdir -p $W
left() { echo $(( ${1} < 570 - SECONDS ? ${1} : 570 - SECONDS )); }
save() { (cd $OUT && tar czf $NAME.tgz $NAME); }
bench() {
    local name=$1 t=$2; shift 2
    [ "$(left $t)" -lt 30 ] && { echo "== $name skipped (${SECONDS}s)"; return; }
    timeout $(left $t) python -m specdec bench --shape $name --context 512 --oracle-tau 6.5 --json $W/b_$name.json \
        "$@" > $W/b_$name.log 2>&1
    echo "== $name rc=$? ${SECONDS}s"; grep -vE "^ *(verify|k=)" $W/b_$name.log | tail -9 | cut -c1-240; save
}
