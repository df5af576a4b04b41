#!/usr/bin/env bash
# Train one recipe in several variants, one after the other, resumable across calls of a time-limited
# machine: a finished variant (its model/ saved) is skipped, an interrupted one resumes from its last
# checkpoint, and no variant starts once DEADLINE seconds have passed since the script began.
#   scripts/ablate.sh RECIPE RUNS_DIR NAME="OVERRIDES" ...
#   DEADLINE=540 scripts/ablate.sh recipes/smollm2-135m-gdn-corpus.yaml /root/w/runs \
#       gdn="" w64s4="convert.window=64 convert.sinks=4" w64s4g="convert.window=64 convert.sinks=4 convert.output_gate=true"
# Extra overrides for every variant (the teacher, the data) come from COMMON. Each run's metrics.jsonl,
# recipe.yaml and initial_eval.json are what scripts/ablation_table.py reads.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: scripts/ablate.sh RECIPE RUNS_DIR NAME=\"OVERRIDES\" ..." >&2; exit 2; }
recipe=$1 runs=$2
shift 2
start=$(date +%s) deadline=${DEADLINE:-540}
mkdir -p "$runs"
for spec in "$@"; do
    name=${spec%%=*} overrides=${spec#*=}
    dir=$runs/$name
    [ -f "$dir/model/config.json" ] && { echo "== $name: done"; continue; }
    left=$(( deadline - ($(date +%s) - start) ))
    [ "$left" -gt 30 ] || { echo "== $name: not started (deadline)"; continue; }
    resume=""
    [ -d "$dir/checkpoints" ] && resume="--resume"
    echo "== $name: $overrides $resume (${left}s left)"
    # shellcheck disable=SC2086  # the overrides are words
    timeout --signal=INT --kill-after=20 "$left" python3 -m linearize distill "$recipe" output.dir="$dir" \
        ${COMMON:-} $overrides $resume
    echo "== $name: exit $? after $(( $(date +%s) - start ))s"
done
