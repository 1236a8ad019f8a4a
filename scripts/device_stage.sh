#!/bin/bash
# One more training stage of the shipped SmolLM2 drafters on the device machine (H200), and their
# benchmark against the shipped ones, as a background job that outlives the calls (held time is
# what counts, so the calls only move files and wait):
#   call 1 (carry .whl .dev/h1; the shipped drafters moved out of the tree):  bash scripts/device_stage.sh part1
#   call 2 (carry .dev/h2; drafters still out):  bash scripts/device_stage.sh start COMMIT DFLASH_MIN MTP_MIN [BRANCHES]
#   call 3 (the tree with the shipped drafters):  bash scripts/device_stage.sh drafters
#   later calls:  bash scripts/device_stage.sh wait SECONDS   (results to $OUT when the job is done)
# While the drafters (specdec/data/drafters/smollm2_135m_instruct) or benchmarks/ are moved out of the tree for a call,
# commit only named files: `git add -A` / `commit -a` would record their deletion (it happened on 2026-12-06 (seventh),
# caught before landing).
# Sampled decoding's captured steps against the eager forms: part1, join, then `sampled COMMIT` (the tree with the
#   shipped drafters; scripts/ab_sampled.py on MT-Bench and GSM8K at T=1, results in $OUT/sampled.tgz).
# Issue 9's main path (generate --compare, the T=0 GSM8K bench, a 2-minute train): part1, join, then `mainpath COMMIT`.
# The draft-vocabulary A/B (no training): part1, then `join` (carry .dev/h2; drafters out), then
#   bash scripts/device_stage.sh vocab   (the tree with the shipped drafters): `specdec bench` on GSM8K (first 100)
#   and HumanEval (first 100), T=0, -n 128: each shipped drafter with its draft_vocab.json and with the whole
#   head (a copy of its directory without the list), in one process a set; then scripts/profile_engine.py (host and
#   device op tables) for dflash with and without its list and for plain decoding; results in $OUT/vocab.tgz.
# The job (`job`): distil the default prompt sets (31,834 prompts; $PROMPTS, if set, names others) once, and BRANCHES (default 0) more replies
# per reply (`specdec train --branches`); wait for the shipped
# drafters; train DFlash (--init shipped, 128 anchors, lr 3e-4, --minutes DFLASH_MIN) and, when MTP_MIN
# is above 0, the MTP head (--init shipped, K=3, lr 3e-4, --minutes MTP_MIN) side by side on the one GPU;
# then `specdec bench` (T=0, -n 128) of the shipped and the new drafters on GSM8K (first 100), HumanEval
# (first 100) and MT-Bench first turns (80), one process per set (each reports the outputs that differ from plain).
# A machine left idle for more than ~30 s between calls goes back, and the job with it (session of
# 2026-12-02 (sixth) lost 14 training minutes so): each `wait` therefore brings back what exists so
# far: the logs and JSONs in one `results.tgz` (the machine returns at most 8 files a call) and the
# DFlash weights of its latest checkpoint (every 3 minutes) as a drafter directory (`dnew_partial`,
# loads with --draft dflash:DIR, continues with --init DIR); when the job is done, `dnew` itself.
set -u
W=/tmp/w
G=/tmp/smol.gguf
# the runs on the joined checkpoint: a machine given back between calls (30 s idle) starts bare, without it
case "$1" in vocab|matrix|sampled|mainpath)
    [ -s $G ] || { echo "device_stage.sh $1: no $G on this machine (a fresh one: the last was given back); run part1 and join first"; exit 2; } ;;
esac
case "$1" in
part1)
    cp .dev/h1/p /tmp/p1 && pip install -q --no-deps --target /tmp/site .whl/gguf-*.whl && ls -la /tmp/p1 ;;
join)
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G ;;
vocab)
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_COMMIT=${2:-unknown}
    rm -rf /tmp/v && mkdir -p /tmp/v $OUT
    for k in dflash mtp; do cp -r specdec/data/drafters/smollm2_135m_instruct/$k /tmp/v/$k-whole && rm /tmp/v/$k-whole/draft_vocab.json; done
    for s in "gsm8k 100" "humaneval 100"; do
        set -- $s
        python -m specdec bench -m $G --dataset $1 --num-prompts $2 --max-turns 1 -n 128 -k 3 --json /tmp/v/vocab_$1.json \
            --drafts none dflash dflash:/tmp/v/dflash-whole dflash+ngram dflash:/tmp/v/dflash-whole+ngram mtp mtp:/tmp/v/mtp-whole \
            2>&1 | tr '\r' '\n' | grep -v "/prompt\]\s*$" > /tmp/v/vocab_$1.log
        tail -n 9 /tmp/v/vocab_$1.log
    done
    # where the DFlash path's host and device time go, with and without the draft vocabulary (the 2026-12-04
    # (fifth) slowdown: prefill 0.37 -> 0.88 s, host draft 0.25 -> 0.49 s per 100 GSM8K prompts since 3952ba3)
    for d in dflash dflash:/tmp/v/dflash-whole none; do
        python scripts/profile_engine.py --model $G --draft $d --prompts 6 --rows 30 > /tmp/v/profile_${d//[:\/]/_}.log 2>&1
        grep "^{" /tmp/v/profile_${d//[:\/]/_}.log
    done
    (cd /tmp/v && tar czf $OUT/vocab.tgz *.json *.log) ;;
matrix)  # COMMIT t0|t1|t1-humaneval: issue 9's matrix with the shipped drafters (the tree with them; after part1 and join): T=0 on GSM8K (first
    # 100), HumanEval (164), MT-Bench (80 first turns), T=1 on the same three sets; none, n-gram and MTP at k = 1..4,
    # DFlash at block 16 and 8; then DFlash with its draft_vocab.json named (the CUDA default is now the whole head)
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_COMMIT=${2:-unknown}
    rm -rf /tmp/m && mkdir -p /tmp/m $OUT
    one() {  # NAME TIMEOUT bench args...
        local name=$1 t=$2; shift 2
        timeout $t python -m specdec bench -m $G --max-turns 1 -n 128 --json /tmp/m/$name.json "$@" 2>&1 | tr '\r' '\n' \
            | grep -v "/prompt\]\s*$" > /tmp/m/$name.log
        grep -E "^\| " /tmp/m/$name.log | cut -c1-110
        (cd /tmp/m && tar czf $OUT/matrix.tgz *.json *.log)
    }
    all="--drafts none ngram mtp dflash -k 1 2 3 4 --block-size 16 8"
    if [ "${3:-t0}" = t0 ]; then
        one vocab_list 60 --dataset gsm8k --num-prompts 100 --drafts none dflash \
            --draft-vocab specdec/data/drafters/smollm2_135m_instruct/dflash/draft_vocab.json
        one t0_gsm8k 150 --dataset gsm8k --num-prompts 100 $all
        one t0_humaneval 220 --dataset humaneval --num-prompts 164 $all
        one t0_mt_bench 150 --dataset mt_bench --num-prompts 80 $all
    elif [ "$3" = t1 ]; then  # T=1 runs ~1.6-1.8 s a prompt with the 11 configurations (2026-12-05 (fourth): GSM8K and
        # HumanEval ran out of 165 / 240 s at 85 / 133 prompts), so it takes two calls: t1, then t1-humaneval
        one t1_gsm8k 260 --dataset gsm8k --num-prompts 100 -t 1 $all
        one t1_mt_bench 230 --dataset mt_bench --num-prompts 80 -t 1 $all
    else
        one t1_humaneval 380 --dataset humaneval --num-prompts 164 -t 1 $all
    fi ;;
sampled)  # COMMIT [SETS]: scripts/ab_sampled.py (sampled acceptance and DFlash's draw in captured steps against the
    # eager forms, T=1, -n 128; none, ngram and mtp at k = 3, dflash block 16) on each set of SETS (default
    # "mt_bench:60:300 gsm8k:40:240", name:prompts:timeout; six variants: ab_sampled.py); the tree with the shipped drafters, after part1 and join
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    rm -rf /tmp/s && mkdir -p /tmp/s $OUT
    for s in ${3:-mt_bench:60:300 gsm8k:40:240}; do
        IFS=: read name n t <<< "$s"
        timeout $t python scripts/ab_sampled.py --model $G --dataset $name --num-prompts $n -n 128 -t 1 \
            --json /tmp/s/sampled_$name.json > /tmp/s/sampled_$name.log 2>&1
        echo "$name rc=$?"; grep "^{" /tmp/s/sampled_$name.log | cut -c1-200
        (cd /tmp/s && echo "${2:-unknown}" > commit.txt && tar czf $OUT/sampled.tgz *)
    done ;;
mainpath)  # COMMIT: issue 9's main path at COMMIT (the tree with the shipped drafters, after part1 and join): generate
    # --compare (plain, then the drafter, same prompt) with auto, dflash and mtp; `specdec bench` T=0 on GSM8K (first 100)
    # with the shipped drafters; a 2-minute `specdec train dflash` from the shipped drafter on 2,000 GSM8K-train prompts
    # (distillation, progress, held-out tau, the drafter written); results in $OUT/mainpath.tgz
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_COMMIT=${2:-unknown}
    rm -rf /tmp/mp && mkdir -p /tmp/mp $OUT
    q="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
    for d in auto dflash mtp; do
        echo "== --draft $d"; python -m specdec generate -m $G --draft $d --compare --chat -n 256 "$q" 2>&1 | tail -8
    done > /tmp/mp/generate.log
    cat /tmp/mp/generate.log | grep -v "^\s*$" | tail -30
    python -m specdec bench -m $G --dataset gsm8k --num-prompts 100 --max-turns 1 -n 128 --drafts none auto dflash mtp ngram -k 3 \
        --json /tmp/mp/t0_gsm8k.json 2>&1 | tr '\r' '\n' | grep -v "/prompt\]\s*$" > /tmp/mp/t0_gsm8k.log
    grep -E "^\| " /tmp/mp/t0_gsm8k.log | cut -c1-120
    (cd /tmp/mp && tar czf $OUT/mainpath.tgz *.log *.json)
    timeout 220 python -m specdec train dflash --target $G --prompts gsm8k_train --max-prompts 2000 --out /tmp/mp/d \
        --data-cache /tmp/mp/dc --init specdec/data/drafters/smollm2_135m_instruct/dflash --minutes 2 --eval-prompts 4 \
        --eval-tokens 96 > /tmp/mp/train_raw.log 2>&1
    echo "train rc=$?" >> /tmp/mp/train_raw.log
    tr '\r' '\n' < /tmp/mp/train_raw.log | awk 'NR % 25 == 0 || /tau|epoch|rc=|rror|wrote|distill/' > /tmp/mp/train.log
    ls -la /tmp/mp/d >> /tmp/mp/train.log 2>&1; tail -15 /tmp/mp/train.log
    (cd /tmp/mp && tar czf $OUT/mainpath.tgz *.log *.json) ;;
start)
    cat /tmp/p1 .dev/h2/p > $G && md5sum $G
    rm -rf /tmp/repo $W && mkdir -p /tmp/repo $W && cp -r specdec scripts tests pyproject.toml /tmp/repo/  # tests: device_check imports its helpers
    setsid nohup bash scripts/device_stage.sh job "$2" "$3" "$4" "${5:-0}" > $W/job.log 2>&1 < /dev/null &
    sleep 20; cat $W/job.log ;;
drafters)
    rm -rf /tmp/drafters && cp -r specdec/data/drafters/smollm2_135m_instruct /tmp/drafters && touch /tmp/drafters/.done
    ls -la /tmp/drafters; tr '\r' '\n' < $W/job.log | tail -5 ;;
wait)
    end=$(( SECONDS + $2 ))
    while [ ! -f $W/done ] && [ $SECONDS -lt $end ]; do sleep 5; done
    tr '\r' '\n' < $W/job.log | grep -v "^ *$" | tail -25
    for f in $W/*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -E "distilled|continued|branches:|epoch|rc=|Error|error|Traceback|tok/s" | tail -8; done
    mkdir -p $OUT
    for f in dnew m3; do [ -f $W/$f.log ] && tr '\r' '\n' < $W/$f.log | awk 'NR % 40 == 0' | tail -40 > $W/${f}_progress.txt; done
    (cd $W && tar czf $OUT/results.tgz *.json *.log *_progress.txt 2>/dev/null)
    if [ -f $W/done ]; then
        cp -r $W/dnew $OUT/ 2>/dev/null
    elif [ -f $W/dnew.ckpt.pt ]; then
        PYTHONPATH=/tmp/site:/tmp/repo python -c "
import json, torch
from specdec.weights.save import save_drafter_dir
st = torch.load('$W/dnew.ckpt.pt', map_location='cpu', weights_only=False)
save_drafter_dir('$OUT/dnew_partial', json.load(open('/tmp/drafters/dflash/config.json')), st['task'],
                 extra_files={'STEP.txt': f\"step {st['step']}, {st['seconds']:.0f} s\\n\"})
print('dnew_partial at step', st['step'])"
    fi ;;
job)
    cd /tmp/repo
    export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1 SPECDEC_COMMIT=$2
    sd() { python -m specdec "$@"; }
    common="--target $G --data-cache $W/dc --eval-prompts 4 --eval-tokens 96 --checkpoint-minutes 3 --epochs 40 --lr 3e-4"
    common="$common ${PROMPTS:+--prompts $PROMPTS}"  # PROMPTS="gsm8k_train chat code self_instruct math": other sets
    sd train dflash --target $G --out $W/x --data-cache $W/dc --slots 512 --eval-prompts 4 ${PROMPTS:+--prompts $PROMPTS} \
        --distill-only --branches "$5" > $W/distill.log 2>&1
    echo "distill rc=$?"
    while [ ! -f /tmp/drafters/.done ]; do sleep 2; done
    sd train dflash $common --branches "$5" --out $W/dnew --minutes "$3" --anchors 128 --init /tmp/drafters/dflash > $W/dnew.log 2>&1 &
    mtp=""
    if [ "$4" != 0 ]; then
        sd train mtp $common --branches "$5" --out $W/m3 --minutes "$4" --steps 3 --init /tmp/drafters/mtp > $W/m3.log 2>&1 &
        mtp="mtp:/tmp/drafters/mtp mtp:$W/m3"
    fi
    wait
    echo "trained: $(ls $W)"
    for s in "gsm8k 100" "humaneval 100" "mt_bench 80"; do
        set -- $s
        sd bench -m $G --dataset $1 --num-prompts $2 --max-turns 1 -n 128 -k 3 --json $W/bench_$1.json \
            --drafts none dflash:/tmp/drafters/dflash dflash:$W/dnew dflash:/tmp/drafters/dflash+ngram dflash:$W/dnew+ngram \
            $mtp > $W/bench_$1.log 2>&1
        echo "bench $1 rc=$?"
    done
    touch $W/done ;;
esac
