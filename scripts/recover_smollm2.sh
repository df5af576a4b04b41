#!/usr/bin/env bash
# The SmolLM2 recovery runs on one GPU machine: both 25M-token recipes at once (every layer converted, L;
# hybrid, 8 of 30 layers softmax, H) under one deadline, each trained model then measured by
# `linearize eval` (the six zero-shot tasks, per-domain perplexity, passkey) while EVAL_SECONDS remain, the
# teacher measured once beside them, and every run's records archived into OUT when the call ends (a
# machine released after a call keeps nothing). Run it in consecutive calls: it resumes where it stopped.
#   W    a folder holding smollm2.gguf, corpus/ and (for the evaluations; a later call may bring it) ev/,
#        the parts scripts/device_carry.sh makes, joined there; the runs go to W/runs
#   OUT  where the records go (the device's $OUT)
# usage: scripts/recover_smollm2.sh W OUT [DEADLINE seconds, default 560]
#   e.g. PYTHONPATH=/root/site:$PWD scripts/recover_smollm2.sh /root/w "$OUT" 560
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/recover_smollm2.sh W OUT [DEADLINE]" >&2; exit 2; }
w=$1 out=$2
for need in "$w/smollm2.gguf" "$w/corpus/manifest.json"; do
    [ -e "$need" ] || { echo "error: $need is missing (join the carried parts into $w first)" >&2; exit 2; }
done
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
export START=${START:-$(date +%s)} DEADLINE=${3:-560} EXPORT=$out EVAL_SECONDS=${EVAL_SECONDS:-240}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export COMMON="teacher.model=$w/smollm2.gguf data.source=corpus:$w/corpus"
export EVAL="--limit 1000 --batch-size 64 --eval-data $w/ev --corpus $w/corpus --seq-len 2048 --ppl-tokens 65536 \
--passkey --passkey-len 2048 --dtype bfloat16"
if [ ! -d "$w/ev/hf_datasets" ]; then  # the task data comes in a later call: train now, evaluate then
    echo "== no task data in $w/ev yet: training only"
    unset EVAL
fi
# shellcheck disable=SC2086  # EVAL is words
[ -f "$w/teacher.json" ] || [ -z "${EVAL:-}" ] || (timeout --signal=INT $((DEADLINE - 30)) python3 -m linearize eval -m "$w/smollm2.gguf" \
    $EVAL -o "$w/teacher.json" > "$w/teacher.log" 2>&1; cp "$w/teacher.json" "$w/teacher.md" "$out/" 2>/dev/null) &
t=$!
bash scripts/ablate.sh recipes/smollm2-135m-gdn-25m.yaml "$w/runs" L= > "$w/L.log" 2>&1 &
a=$!
bash scripts/ablate.sh recipes/smollm2-135m-hybrid-25m.yaml "$w/runs" H= > "$w/H.log" 2>&1 &
b=$!
wait $a $b $t  # the scripts' own PIDs: a pgrep -f on a path would also match this shell
tail -n 4 "$w/L.log" "$w/H.log"
cp "$w/teacher.json" "$out/" 2>/dev/null
exit 0
