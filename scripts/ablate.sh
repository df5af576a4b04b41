#!/usr/bin/env bash
# Train one recipe in several variants, one after the other, resumable across calls of a time-limited
# machine: a finished variant (its model/ saved) is skipped, an interrupted one resumes from its last
# checkpoint, and no variant starts once DEADLINE seconds have passed since START.
#   scripts/ablate.sh RECIPE RUNS_DIR NAME="OVERRIDES" ...
#   DEADLINE=540 scripts/ablate.sh recipes/smollm2-135m-gdn-corpus.yaml /root/w/runs \
#       gdn="" w64s4="convert.window=64 convert.sinks=4" w64s4g="convert.window=64 convert.sinks=4 convert.output_gate=true"
# Environment:
#   COMMON    overrides for every variant (the teacher, the data)
#   DEADLINE  seconds (default 540) from START after which nothing starts and a running step is stopped
#   START     the epoch second DEADLINE counts from (default: now); export it to chain several calls of
#             this script under one deadline: START=$(date +%s) DEADLINE=540 bash -c 'ablate.sh …; ablate.sh …'
#   EVAL      if set, `linearize eval` options: each trained variant is then measured (model alone,
#             --teacher none) into RUNS_DIR/NAME/quality.json, when EVAL_SECONDS (default 300) remain —
#             on the same machine, so a model that lives only there is measured before it is gone
#   EXPORT    if set, a folder (the device's $OUT) that receives, when the script ends or is stopped, one
#             archive records_NAMES.tgz of every variant's records (metrics.jsonl, recipe.yaml,
#             initial_eval.json, quality.json/.md): a machine released after the call keeps nothing else
# Each run's metrics.jsonl, recipe.yaml and initial_eval.json are what scripts/ablation_table.py reads.
# Two recipes at once on one GPU, under one deadline — wait on the scripts' own PIDs (a `pgrep -f` on a
# run's path also matches the shell that runs the whole command line, and never returns):
#   export START=$(date +%s) DEADLINE=540 EXPORT=$OUT
#   bash scripts/ablate.sh recipes/a.yaml RUNS A= & a=$!; bash scripts/ablate.sh recipes/b.yaml RUNS B= & b=$!
#   wait $a $b
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: scripts/ablate.sh RECIPE RUNS_DIR NAME=\"OVERRIDES\" ..." >&2; exit 2; }
recipe=$1 runs=$2
shift 2
start=${START:-$(date +%s)} deadline=${DEADLINE:-540}
left() { echo $(( deadline - ($(date +%s) - start) )); }
mkdir -p "$runs"
names=()
for spec in "$@"; do names+=("${spec%%=*}"); done
export_records() {
    [ -n "${EXPORT:-}" ] || return 0
    local files=() n f
    for n in "${names[@]}"; do
        for f in metrics.jsonl recipe.yaml initial_eval.json quality.json quality.md; do
            [ -f "$runs/$n/$f" ] && files+=("$n/$f")
        done
    done
    [ ${#files[@]} -gt 0 ] || return 0
    mkdir -p "$EXPORT" && tar czf "$EXPORT/records_$(IFS=_; echo "${names[*]}").tgz" -C "$runs" "${files[@]}" \
        && echo "== records of ${names[*]} in $EXPORT"
}
trap export_records EXIT
for spec in "$@"; do
    name=${spec%%=*} overrides=${spec#*=}
    dir=$runs/$name
    if [ ! -f "$dir/model/config.json" ]; then
        [ "$(left)" -gt 30 ] || { echo "== $name: not started (deadline)"; continue; }
        resume=""
        [ -d "$dir/checkpoints" ] && resume="--resume"
        echo "== $name: $overrides $resume ($(left)s left)"
        # shellcheck disable=SC2086  # the overrides are words
        timeout --signal=INT --kill-after=20 "$(left)" python3 -m linearize distill "$recipe" output.dir="$dir" \
            ${COMMON:-} $overrides $resume
        echo "== $name: exit $? after $(( $(date +%s) - start ))s"
    else
        echo "== $name: trained"
    fi
    if [ -n "${EVAL:-}" ] && [ -f "$dir/model/config.json" ] && [ ! -f "$dir/quality.json" ]; then
        if [ "$(left)" -gt "${EVAL_SECONDS:-300}" ]; then
            echo "== $name: eval ($(left)s left)"
            # shellcheck disable=SC2086
            timeout --signal=INT --kill-after=20 "$(left)" python3 -m linearize eval -m "$dir/model" --teacher none \
                $EVAL -o "$dir/quality.json"
            echo "== $name: eval exit $? after $(( $(date +%s) - start ))s"
        else
            echo "== $name: eval not started (deadline)"
        fi
    fi
done
