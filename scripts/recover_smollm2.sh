#!/usr/bin/env bash
# The SmolLM2 recovery runs on one GPU machine: both 25M-token recipes at once (every layer converted, L;
# hybrid, 8 of 30 layers softmax, H), each trained model then measured by `linearize eval` (the six
# zero-shot tasks, per-domain perplexity, passkey; then the model after align, saved by output.save_stages,
# into quality_align.json; then MMLU of each, quality_mmlu.json and quality_align_mmlu.json) and the teacher
# measured beside them on the same rows. Resumable: rerun it and a trained model is not trained again, a
# measured one not measured.
#   W    a folder holding smollm2.gguf and corpus/, the parts scripts/device_carry.sh makes, joined there;
#        the task data may come later: when training ends without W/ev/hf_datasets, each run waits for it
#        (until EVAL_SECONDS are left; default 180: on an H100 a trained model's evaluation takes ~65 s and MMLU
#        ~100 s beside it). The runs go to W/runs.
#   OUT  where the records go: OUT/records.tgz (every run's metrics.jsonl, recipe.yaml, initial_eval.json,
#        quality*.json/.md, the teacher's, the logs), rewritten as each run ends
# usage: scripts/recover_smollm2.sh W OUT [DEADLINE seconds, default 560]
#        scripts/recover_smollm2.sh --records W OUT     # OUT/records.tgz of what exists now, then stop
#        scripts/recover_smollm2.sh --eval-options W    # the `linearize eval` options the runs take
#        scripts/recover_smollm2.sh --corpus-split DIR  # the corpus split they measure perplexity on
#        scripts/recover_smollm2.sh --mmlu-options W    # the `linearize eval` options of their MMLU
# Environment: ONLY=L or ONLY=H runs one of the two; DISTILL_STEPS=N overrides the distill stage's steps
# (the runs are then named L_dN, H_dN: e.g. DISTILL_STEPS=1680 for a 4.9M + 55M = 60M-token budget);
# INIT=1 also measures each model as converted (MMLU too), before training (`linearize convert` with the
# recipe's block options into W/runs/L_init, H_init — H_8_induction_init for EXTRA=convert.keep_softmax=8:induction),
# beside the teacher; INIT=L, H or LH names the conversions whatever ONLY runs; EXTRA="key=value ..." adds overrides to
# both recipes and TAG=name to the runs' names (e.g. EXTRA=convert.write_gate=true TAG=_wg: runs L_wg, H_wg);
# ROPE=yarn:4:2048 measures each trained model and the teacher once more, passkey and perplexity only, with that
# RoPE scaling (`linearize eval --rope-scaling`; ROPE_LAYERS=softmax: on a hybrid's kept softmax layers only),
# into quality_rope.json and teacher_rope.json; KEYS=N measures each trained model and the teacher once more,
# passkey only, with N named keys a prompt (`linearize eval --passkey-keys N`), into quality_keys.json and teacher_keys.json;
# EVAL_OPTIONS replaces the evaluation's options after --eval-data (a smoke run on a CPU: EXTRA="device=cpu
# precision=fp32 stages.0.steps=2 …" EVAL_OPTIONS="--limit 4 --tasks piqa --ppl-tokens 0"); MMLU=0 skips MMLU,
# ALIGN_EVAL=0 the evaluation of the model after align (ALIGN_ONLY=1: that model alone, runs L_align, H_align:
# the distill stage cut to one step, the model it ends with not measured); OVERLAP=0 runs the evaluations one
# after the other (by default the after-align one starts beside the distill stage as soon as model-align/ is saved, and MMLU beside
# the final evaluation, so that they do not add up after the training; untimed on a GPU so far).
# A machine that keeps background processes between calls (the device's setsid) runs it once for the
# whole session, each call bringing a part and copying OUT into its own $OUT:
#   setsid nohup scripts/recover_smollm2.sh /root/w /root/w/out 1300 > /root/w/recover.log 2>&1 < /dev/null &
set -uo pipefail
records() {  # W OUT
    local files
    mkdir -p "$2"
    files=$(cd "$1" && ls -d runs/*/metrics.jsonl runs/*/recipe.yaml runs/*/initial_eval.json runs/*/quality*.json \
        runs/*/quality*.md runs/*/model/distill_summary.json runs/*/model/fidelity.json teacher*.json teacher*.md ./*.log \
        2>/dev/null)
    [ -n "$files" ] || return 0
    # shellcheck disable=SC2086  # the file names are words
    tar czf "$2/records.tgz.$BASHPID" -C "$1" $files && mv "$2/records.tgz.$BASHPID" "$2/records.tgz"  # one writer each
}
corpus_split() {  # DIR: test where the corpus has that split (the runs chose nothing on it), else heldout
    python3 -c "import sys; from linearize.corpus.reader import open_corpus
print('test' if 'test' in open_corpus(sys.argv[1]).splits else 'heldout')" "$1" 2>/dev/null || echo heldout
}
mmlu_options() {  # W: the options of `linearize eval` for MMLU (also the Gemma runs', scripts/device_calls.sh, with
    # MMLU_BATCH=16: Gemma's 262K-token vocabulary at 64 rows a batch ran the teacher out of an H100's memory)
    echo "--teacher none --tasks mmlu --limit 1000 --batch-size ${MMLU_BATCH:-64} --eval-data $1/ev --ppl-tokens 0 --dtype bfloat16"
}
eval_options() {  # W: the options of `linearize eval` after the task data (EVAL_OPTIONS replaces the default)
    echo "--eval-data $1/ev ${EVAL_OPTIONS:---limit 1000 --batch-size 64 --corpus $1/corpus --corpus-split $(corpus_split "$1/corpus") \
--seq-len 2048 --ppl-tokens 65536 --passkey --passkey-len 2048 --dtype bfloat16}"
}
if [ "${1:-}" = "--eval-options" ]; then  # for other runs measured on the same rows (scripts/device_calls.sh ablate)
    [ $# -eq 2 ] || { echo "usage: scripts/recover_smollm2.sh --eval-options W" >&2; exit 2; }
    eval_options "$2"
    exit 0
fi
if [ "${1:-}" = "--mmlu-options" ]; then
    [ $# -eq 2 ] || { echo "usage: scripts/recover_smollm2.sh --mmlu-options W" >&2; exit 2; }
    mmlu_options "$2"
    exit 0
fi
if [ "${1:-}" = "--corpus-split" ]; then  # for other runs on a corpus of their own (scripts/device_calls.sh: Gemma)
    [ $# -eq 2 ] || { echo "usage: scripts/recover_smollm2.sh --corpus-split DIR" >&2; exit 2; }
    corpus_split "$2"
    exit 0
fi
if [ "${1:-}" = "--records" ]; then
    [ $# -eq 3 ] || { echo "usage: scripts/recover_smollm2.sh --records W OUT" >&2; exit 2; }
    records "$2" "$3"
    exit 0
fi
[ $# -ge 2 ] || { echo "usage: scripts/recover_smollm2.sh W OUT [DEADLINE]" >&2; exit 2; }
w=$1 out=$2
for need in "$w/smollm2.gguf" "$w/corpus/manifest.json"; do
    [ -e "$need" ] || { echo "error: $need is missing (join the carried parts into $w first)" >&2; exit 2; }
done
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
echo $$ > "$w/recover.pid"  # for a caller that waits on it (scripts/device_calls.sh wait)
export START=${START:-$(date +%s)} DEADLINE=${3:-560} EVAL_SECONDS=${EVAL_SECONDS:-180}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export COMMON="teacher.model=$w/smollm2.gguf data.source=corpus:$w/corpus"
eval_options=$(eval_options "$w")
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
echo "== $(left) s left; an evaluation starts while more than $EVAL_SECONDS s are left"
wait_ev() {  # the task data, which a later call may bring
    while [ ! -d "$w/ev/hf_datasets" ]; do
        [ "$(left)" -gt "$EVAL_SECONDS" ] || { echo "== no task data in $w/ev before the deadline"; return 1; }
        sleep 10
    done
}
eval_once() {  # MODEL OUTPUT OPTIONS...: `linearize eval` of MODEL into OUTPUT, unless OUTPUT exists or less than
    local model=$1 output=$2  # 120 s are left (stopped 20 s before the deadline)
    shift 2
    [ -f "$output" ] || [ "$(left)" -lt 120 ] || timeout --signal=INT --kill-after=20 $(( $(left) - 20 )) python3 -m \
        linearize eval -m "$model" "$@" -o "$output"
}
mmlu() {  # MODEL OUTPUT: MMLU last, as time allows (it is the longest task and outside the 6-task average)
    [ "${MMLU:-1}" = 1 ] || return 0
    # shellcheck disable=SC2046  # the options are words
    eval_once "$1" "$2" $(mmlu_options "$w")
}
rope() {  # MODEL OUTPUT LAYERS: with ROPE=KIND:FACTOR[:ORIGINAL], passkey and perplexity again under that RoPE
    [ -n "${ROPE:-}" ] || return 0  # scaling, on LAYERS (all, or softmax: the kept softmax layers only)
    # shellcheck disable=SC2086  # the options are words
    eval_once "$1" "$2" --teacher none $eval_options --tasks none --rope-scaling "$ROPE" --rope-scaling-layers "$3"
}
named_keys() {  # MODEL OUTPUT: with KEYS=N, the passkey again with N named keys a prompt, one asked for by name
    [ -n "${KEYS:-}" ] || return 0
    # shellcheck disable=SC2086  # the options are words
    eval_once "$1" "$2" --teacher none $eval_options --tasks none --ppl-tokens 0 --passkey-keys "$KEYS"
}
after_align() {  # RUN_DIR: the model the align stage ended with (output.save_stages), measured the same way
    [ "${ALIGN_EVAL:-1}" = 1 ] || return 0
    # shellcheck disable=SC2086  # the options are words
    [ ! -f "$1/model-align/config.json" ] || eval_once "$1/model-align" "$1/quality_align.json" --teacher none $eval_options
}
align_mmlu() {  # RUN_DIR: MMLU of the model after align (ALIGN_EVAL=0: not)
    [ "${ALIGN_EVAL:-1}" = 1 ] || return 0
    [ ! -f "$1/model-align/config.json" ] || mmlu "$1/model-align" "$1/quality_align_mmlu.json"
}
align_beside() {  # RUN_DIR: the after-align evaluation as soon as model-align/ is saved, beside the distill stage
    while [ ! -f "$1/model-align/config.json" ] && [ ! -f "$1/model/config.json" ]; do  # (saved atomically)
        [ "$(left)" -gt "$EVAL_SECONDS" ] || return 0
        sleep 10
    done
    wait_ev || return 0
    after_align "$1"
    records "$w" "$out"
    align_mmlu "$1"
    records "$w" "$out"
}
recover() {  # NAME RECIPE [OVERRIDES]
    local keys="output.save_stages=true ${3:-}"  # model-align/ too, for the after-align column
    local beside=
    if [ "${OVERLAP:-1}" = 1 ]; then  # beside the training, not after it
        align_beside "$w/runs/$1" > "$w/$1_align.log" 2>&1 &
        beside=$!
    fi
    bash scripts/ablate.sh "$2" "$w/runs" "$1=$keys" || true
    if [ "${ALIGN_ONLY:-0}" = 1 ]; then  # the model after align alone: its evaluation, then its MMLU
        [ -z "$beside" ] || wait "$beside"
        wait_ev && after_align "$w/runs/$1" && align_mmlu "$w/runs/$1"
        records "$w" "$out"
        return 0
    fi
    if [ -n "$beside" ] && [ ! -f "$w/runs/$1/model-align/config.json" ]; then  # no align stage saved: nothing to
        kill "$beside" 2> /dev/null; wait "$beside" 2> /dev/null; beside=  # wait for (the later call measures it)
    fi
    records "$w" "$out"
    rope "$w/runs/$1/model" "$w/runs/$1/quality_rope.json" "${ROPE_LAYERS:-all}"  # first: it is why ROPE is set
    records "$w" "$out"
    wait_ev || { [ -z "$beside" ] || wait "$beside"; return 0; }
    local mmlu_pid=
    if [ "${OVERLAP:-1}" = 1 ]; then  # MMLU beside the final evaluation, not after it
        { mmlu "$w/runs/$1/model" "$w/runs/$1/quality_mmlu.json"; records "$w" "$out"; } > "$w/$1_mmlu.log" 2>&1 &
        mmlu_pid=$!
    fi
    EVAL=$eval_options bash scripts/ablate.sh "$2" "$w/runs" "$1=$keys" || true
    records "$w" "$out"
    named_keys "$w/runs/$1/model" "$w/runs/$1/quality_keys.json"
    records "$w" "$out"
    [ -z "$beside" ] || wait "$beside"
    after_align "$w/runs/$1"  # (measured already where it ran beside the training: eval_once skips it)
    records "$w" "$out"
    align_mmlu "$w/runs/$1"
    records "$w" "$out"
    [ -z "$mmlu_pid" ] || wait "$mmlu_pid"
    mmlu "$w/runs/$1/model" "$w/runs/$1/quality_mmlu.json"
    records "$w" "$out"
}
teacher() {
    wait_ev || return 0
    # shellcheck disable=SC2086  # the options are words
    [ -f "$w/teacher.json" ] || [ "$(left)" -lt 60 ] || timeout --signal=INT --kill-after=20 $(( $(left) - 30 )) \
        python3 -m linearize eval -m "$w/smollm2.gguf" \
        $eval_options -o "$w/teacher.json"
    records "$w" "$out"
    named_keys "$w/smollm2.gguf" "$w/teacher_keys.json"
    records "$w" "$out"
    rope "$w/smollm2.gguf" "$w/teacher_rope.json" all
    records "$w" "$out"
    mmlu "$w/smollm2.gguf" "$w/teacher_mmlu.json"
    records "$w" "$out"
}
at_init() {  # NAME CONVERT_OPTIONS...: the model as converted, measured like the trained ones
    local name=$1 dir=$w/runs/$1_init
    shift
    wait_ev || return 0
    [ -f "$dir/model/config.json" ] || [ "$(left)" -lt "$EVAL_SECONDS" ] || python3 -m linearize convert \
        -m "$w/smollm2.gguf" "$@" -o "$dir/model" --force
    # shellcheck disable=SC2086  # the options are words
    [ ! -f "$dir/model/config.json" ] || eval_once "$dir/model" "$dir/quality.json" --teacher none $eval_options
    records "$w" "$out"
    [ ! -f "$dir/model/config.json" ] || mmlu "$dir/model" "$dir/quality_mmlu.json"
    records "$w" "$out"
    echo "== $name at init: done"
}
tag=${TAG:-} extra=${EXTRA:-}
[ -z "${DISTILL_STEPS:-}" ] || { tag="${tag}_d$DISTILL_STEPS" extra="$extra stages.1.steps=$DISTILL_STEPS"; }
[ "${ALIGN_ONLY:-0}" != 1 ] || { tag="${tag}_align" extra="$extra stages.1.steps=1"; }  # a stage needs a step
pids=()
for run in L:recipes/smollm2-135m-gdn-25m.yaml H:recipes/smollm2-135m-hybrid-25m.yaml; do
    name=${run%%:*}
    [ -z "${ONLY:-}" ] || [ "$ONLY" = "$name" ] || continue
    recover "$name$tag" "${run#*:}" "$extra" > "$w/$name$tag.log" 2>&1 &
    pids+=($!)
done
teacher > "$w/teacher.log" 2>&1 &
pids+=($!)
init=${INIT:-}
[ "$init" != 1 ] || init=${ONLY:-LH}
keep=$(sed -n 's/.*convert\.keep_softmax=\([^ ]*\).*/\1/p' <<< "$extra")  # the hybrid's rule, as trained
if [ -n "$init" ]; then  # one after the other, beside the training
    ( case $init in *L*) at_init L --window 64 --sinks 4 ;; esac
      case $init in *H*) at_init "H${keep:+_$(tr -c 'a-z0-9\n' _ <<< "$keep")}" --window 64 --sinks 4 \
          --keep-softmax "${keep:-8:induction}" ;; esac ) > "$w/init.log" 2>&1 &
    pids+=($!)
fi
wait "${pids[@]}"  # their own PIDs: a pgrep -f on a path would also match the shell running this line
records "$w" "$out"
tail -n 4 "$w"/[LH]*.log
echo "== recover_smollm2.sh: done"
exit 0
