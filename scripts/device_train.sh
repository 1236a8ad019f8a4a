#!/bin/bash
# Train the shipped SmolLM2 drafters on the device machine (H200), in calls of at most 10 minutes.
# The 98 MB target travels in two halves (.dev/a/part1, .dev/b/part2; see BENCHMARKS.md).
#   bash scripts/device_train.sh part1            # first call: keep half 1 outside the checkout
#   bash scripts/device_train.sh dflash SECONDS   # join, distil, train DFlash (resumes a checkpoint)
#   bash scripts/device_train.sh mtp SECONDS      # train the MTP head (K=4 chained)
# Everything under /tmp survives between calls while the machine stays warm; results go to $OUT.
# Carried along (ignored paths, `carry`): .dev/trained/cache (a reply cache: no distillation) and
# .dev/trained/{dflash,mtp} (set INIT=1 to continue from them with --init; INIT_DIR=DIR for another
# directory). ANCHORS and EPOCHS override the DFlash anchors (64) and the epochs (dflash 6, mtp 1).
set -u
export PYTHONPATH=/tmp/site:$PWD
G=/tmp/smollm2.gguf
log() { tr '\r' '\n' < "$1" | grep -E "distilled|^data:|epoch|resuming|stopped|error|Error|Traceback|File \"|^\{" | tail -40; }
case "$1" in
part1)
    cp .dev/a/part1 /tmp/part1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl && ls -la /tmp/part1 ;;
dflash|mtp)
    budget=$2
    [ -f $G ] || { cat /tmp/part1 .dev/b/part2 > $G && sha256sum $G; }
    if [ -d .dev/trained/cache ]; then mkdir -p /tmp/dc /tmp/dr && cp -n .dev/trained/cache/*.pt /tmp/dc/; fi
    if [ "$1" = dflash ] && ! ls /tmp/dc/replies-*.pt >/dev/null 2>&1; then
        python -m specdec train dflash --target $G --out /tmp/dr/dflash --data-cache /tmp/dc --slots 512 \
            --distill-only > /tmp/distill.log 2>&1; echo "distill rc=$?"; log /tmp/distill.log
    fi
    left=$(( budget - SECONDS - 25 ))
    mins=$(python -c "print(max(0.5, $left / 60))")
    if [ "$1" = dflash ]; then
        extra="--anchors ${ANCHORS:-64} --epochs ${EPOCHS:-6}"
    else
        extra="--steps 4 --epochs ${EPOCHS:-1}"
    fi
    init=${INIT_DIR:-.dev/trained/$1}
    if [ "${INIT:-0}" = 1 ] && [ -d "$init" ]; then extra="$extra --init $init"; fi
    mkdir -p /tmp/dr
    python -m specdec train $1 --target $G --out /tmp/dr/$1 --data-cache /tmp/dc --eval-prompts 4 \
        --eval-tokens 96 --checkpoint-minutes 1 --time-limit "$mins" $extra > /tmp/train_$1.log 2>&1
    echo "train $1 rc=$?"; log /tmp/train_$1.log
    mkdir -p $OUT/$1; cp /tmp/dc/replies-*.pt $OUT/ 2>/dev/null
    [ -d /tmp/dr/$1 ] && cp -r /tmp/dr/$1 $OUT/
    tr '\r' '\n' < /tmp/train_$1.log | awk 'NR % 50 == 0' | tail -30 > $OUT/$1/progress.txt ;;
esac
