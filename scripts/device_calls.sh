#!/usr/bin/env bash
# The steps of a session on a GPU machine that starts bare and is reached by short calls, each call
# carrying one part that scripts/device_carry.sh made (the SmolLM2 teacher, wheels, a corpus subset, the
# task data) into /root/w, and the recovery runs (scripts/recover_smollm2.sh) started once in the
# background so that they outlive the calls. Send the calls back to back (a machine idle for 30 s goes).
#   scripts/device_calls.sh wheels       carry .carry/w .carry/g1    the training wheels, the teacher's part 1 (where
#                                        the two and the tree pass 64 MiB: .carry/g1 in one call, .carry/w .carry/g2
#                                        in the next; 'teacher' then needs no .carry/g2)
#   scripts/device_calls.sh lm-eval      carry .whl                  lm-eval's wheels (beside .carry/g2 or .carry/ev
#                                                                    and a 13.7 MB tree they pass a call's 64 MiB;
#                                                                    beside .carry/corpus_3 they fit: 'lm-eval &&
#                                                                    corpus-part .carry/corpus_3')
#   scripts/device_calls.sh teacher      carry .carry/g2             part 2 joined; the repo copied to
#                                                                    /root/repo (the runs read it)
#   scripts/device_calls.sh start DIR [DEADLINE]   carry DIR (.carry/corpus25 or .carry/corpus): the corpus,
#                                        then recover_smollm2.sh in the background (its environment —
#                                        ONLY, EXTRA, TAG, DISTILL_STEPS, INIT, ROPE, KEYS, MMLU — passed on); DEADLINE in
#                                        seconds from now (default 1200)
#   scripts/device_calls.sh corpus-part DIR   before 'start', for a subset in parts (above ~25M tokens): carry
#                                        DIR (.carry/corpus_2, then _3 …): its training shards, which 'start' joins
#   scripts/device_calls.sh evaldata     carry .carry/ev: the task data, which the runs wait for
#   scripts/device_calls.sh wait SECONDS  until the runs end or SECONDS pass; then what they wrote
#   scripts/device_calls.sh fla          carry .carry/fla: flash-linear-attention, for scripts/bench_kernels.py
#   scripts/device_calls.sh kernels [OPS] [SHAPES] [TESTS]   after 'wheels', carry .carry/fla .carry/pytest (and
#                                        .carry/w: then no 'wheels' call is needed): the
#                                        operators OPS (default "linear gdn"; "none": the tests alone) timed against fla at SHAPES
#                                        (default the long ones, 2x8192,1x16384,1x32768) into OUT/bench_OP.json, then
#                                        the GPU tests matching TESTS (a pytest -k expression; default: the mix
#                                        kernel, the prefill through the fused front and the kernels, its default
#                                        without gradients, the harness's fitted batch) into
#                                        OUT/gpu_tests.log (TESTS "skip": none); BENCH_FLAGS adds options to
#                                        bench_kernels.py (--kda-no-chunk-dots --decays taylor …), BENCH_TAG to the
#                                        JSONs' names; AB=1 (carry ab): before them, each of OPS (or of AB_OPS) at
#                                        SHAPES (or AB_SHAPES) in every tree of scripts/ab.sh, without fla
#                                        (OUT/ab_OP/<tree>.bench_kernels.json; AB_ROUNDS=N: N interleaved rounds,
#                                        scripts/ab_table.py's medians in the log); AB_FLAGS ("--a;--b c", ';' between
#                                        flag sets; a leading ';' adds a run without flags): each of AB_OPS with
#                                        each flag set in this tree, without fla and without BENCH_FLAGS
#                                        (OUT/ab_OP/<the flags' letters and digits>.json); AB_TESTS (a pytest -k
#                                        expression; carry ab): after the timings and profiles, the GPU tests matching
#                                        it in each tree (AB_TREES: those only), its own tests/ on its linearize/
#                                        (OUT/ab_tests/<tree>.log; -k matches the tree's folder name too: "linear"
#                                        takes every test of a tree named linear-…); EARLY_TESTS=1: the tests
#                                        after the A/Bs, before the timings against fla; PROFILE_OPS
#                                        ("linear kda"): after the timings, scripts/profile_kernels.py --op OP
#                                        at PROFILE_SHAPES (its names; default 2x8192) into OUT/profile_OP.json;
#                                        Triton's autotuning is cached: OUT/autotune.tgz holds every autotuned
#                                        kernel's timings (fla's), which an earlier run's copy carried as
#                                        .carry/tcache/autotune.tgz gives back (fla then compiles only the configs
#                                        it chose on that machine: minutes less per operator; dropped where they
#                                        come from another kind of GPU); the compiled kernels come back too, the
#                                        timings' as OUT/bench_kernels.tgz (after each operator), the GPU tests' as
#                                        OUT/test_kernels.tgz (each in parts of 15 MB, .tgz.00 …, where larger),
#                                        which carried in .carry/tcache spare a re-run on the same kind of GPU the
#                                        compiling (the timings' compiling is most of their time; a call carries
#                                        64 MiB with the ~15 MB tree: carry what fits)
#   scripts/device_calls.sh kernels-start [OPS] [SHAPES] [TESTS]   the same step in the background, its files into
#                                        W/kernels (a whole table against fla outlasts a call: fla compiles and
#                                        autotunes for minutes per operator); SHAPES "all": every shape of the bench
#   scripts/device_calls.sh kernels-wait [SECONDS]   until that step ends or SECONDS pass (default 540); then its
#                                        files so far into OUT/kernels.tgz (a call brings back 8 files at most),
#                                        OUT/autotune.tgz and the compiled kernels so far beside it, and its log's
#                                        end; call again while it runs
#   scripts/device_calls.sh gpu-tests [TESTS]   after 'teacher' (and 'lm-eval' for the harness's tests), carry
#                                        .carry/pytest: the GPU tests matching TESTS (pytest -k; default as 'kernels')
#                                        in the background, from a copy of tests/ beside the repo, so that they run
#                                        beside the training; their log comes back with every step's records
#                                        (gpu_tests.log; its last line says when they have ended)
#   scripts/device_calls.sh ablate DEADLINE NAME="OVERRIDES" ...   after 'start': the variants of ABLATE_RECIPE
#                                        (default recipes/smollm2-135m-gdn-corpus.yaml) trained into W/aruns/NAME by
#                                        background scripts/ablate.sh, ABLATE_LANES of them at once (default: one
#                                        per 40 GiB of GPU memory: 3 on an H200, 1 on an H100),
#                                        beside the runs of 'start', then measured by `linearize eval` as those are
#                                        (the teacher's figures are theirs: the same rows); records_ablate.tgz
# Gemma 3 270M (recipes/gemma3-270m-gdn-25m.yaml, the parts of scripts/device_carry_gemma.sh), alone or beside
# the SmolLM2 runs on the same machine:
#   scripts/device_calls.sh gemma-part DIR   carry DIR (.carry/gm1 with .whl .carry/w, then .carry/gm2 … up to the
#                                        last but one): a part of the teacher into W/gemma; with .whl carried, the
#                                        wheels and the repo too
#   scripts/device_calls.sh gemma-start [DEADLINE] [STEPS]   carry the last part (the .carry/gmN with SHA256SUMS,
#                                        as scripts/device_carry_gemma.sh names it): the teacher joined and checked, its
#                                        tokenizer beside it, the corpus (and the task data unless W/ev is there);
#                                        then in the background the recipe (distill STEPS, default 600) with
#                                        `linearize eval` of the model once trained (GEMMA_EVAL replaces its
#                                        options, GEMMA_EXTRA adds overrides, GEMMA_TAG to its name G<STEPS>) and
#                                        the teacher's evaluation (GEMMA_TEACHER=0: not), each then MMLU where
#                                        GEMMA_MMLU=1 (as time allows: quality_mmlu.json, gemma_teacher_mmlu.json); GEMMA_RECIPE names
#                                        another Gemma recipe (recipes/gemma3-270m-gdn-global.yaml), which the
#                                        later 'gemma-more' calls keep unless they name one
#   scripts/device_calls.sh gemma-more NAME "OVERRIDES" [DEADLINE]   once the run before has ended: another
#                                        run of the recipe on the same teacher and corpus (W/gruns/NAME; its
#                                        overrides are OVERRIDES alone, GEMMA_EXTRA and the steps do not apply)
# A run longer than a session's device time goes on in the next session's machine (its newest checkpoint and
# records travel through this machine, scripts/device_relay.sh):
#   scripts/device_calls.sh relay-out RUN   the runs stopped, W/runs/RUN packed (its newest checkpoint and records,
#                                        not model*/ or tensorboard/; once trained, its model/ instead of the
#                                        checkpoint, which 'start' then measures) in parts of 15 MiB; each call
#                                        brings back the next four and RUN.sha256 (~27 calls for a SmolLM2
#                                        distill checkpoint)
#   scripts/device_calls.sh relay-in DIR   before 'start', carry DIR (.carry/relay1, relay2 …): its parts; with the
#                                        last, RUN is checked and unpacked into W/runs, where 'start' resumes it
# Keep calls coming while waiting (`wait SECONDS`): the machine goes after 30 s without one.
# Send a step that starts runs to a file (`... > $OUT/step.log 2>&1; tail $OUT/step.log`), not into a pipe:
# piped (`| tail`), a gemma-start call waited out its time limit after the runs had started.
# Every step ends by copying the records so far (records.tgz, logs) into $OUT. PYTHONPATH: /root/site.
set -uo pipefail
w=${DEVICE_W:-/root/w} site=${DEVICE_SITE:-/root/site} repo=${DEVICE_REPO:-/root/repo}  # elsewhere: a smoke run
out=${OUT:?OUT is the device call\'s output folder}
die() { echo "error: $1 (scripts/device_calls.sh: see its header)" >&2; exit 2; }
export PYTHONPATH=$site:$repo
records() {
    [ -x "$repo/scripts/recover_smollm2.sh" ] && bash "$repo/scripts/recover_smollm2.sh" --records "$w" "$out"
    cp "$w"/recover.log "$w"/gpu_tests.log "$out"/ 2>/dev/null
    tail -n 3 "$w"/[LH]*.log "$w"/teacher.log "$w"/init.log 2>/dev/null | cut -c1-300
    if [ -d "$w/aruns" ]; then  # the variants of 'ablate'
        pack records_ablate.tgz 'aruns/*/metrics.jsonl aruns/*/recipe.yaml aruns/*/initial_eval.json aruns/*/quality.*
            ablate_*.log'
        tail -n 2 "$w"/ablate_*.log 2>/dev/null | cut -c1-300
    fi
    if [ -e "$w/gemma.log" ]; then  # the Gemma run's records and logs
        pack records_gemma.tgz 'gruns/*/metrics.jsonl gruns/*/recipe.yaml gruns/*/initial_eval.json gruns/*/quality.*
            gruns/*/model/distill_summary.json gruns/*/quality_mmlu.* gemma_teacher.json gemma_teacher.md gemma_teacher_mmlu.*
            gemma.log gemma_teacher.log'
        tail -n 2 "$w"/gemma.log "$w"/gemma_teacher.log 2>/dev/null | cut -c1-300
    fi
    return 0
}
pack() {  # ARCHIVE 'GLOBS': the files under W the globs match, into OUT/ARCHIVE (when there is one)
    local files
    # shellcheck disable=SC2086  # the globs expand under W, the file names are words
    files=$(cd "$w" && ls -d $2 2>/dev/null)
    # shellcheck disable=SC2086
    [ -z "$files" ] || tar czf "$out/$1" -C "$w" $files
}
running() {  # PIDFILE: its process is alive
    kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null
}
cache_out() {  # DIR NAME PARTS: the compiled kernels under the Triton cache DIR (their cubins and metadata,
    # what Triton loads a cached kernel from; autotuning's choices too) into OUT/NAME.tgz, or in parts of 15 MB
    # (NAME.tgz.00 …) where larger, at most PARTS of them (a call brings back 8 files of 16 MiB and carries 64
    # MiB); carried back as .carry/tcache/NAME.tgz* (cache_in), a later run of unchanged kernels on the same kind
    # of GPU and compiler skips compiling them. Written aside, then moved: a 'kernels-wait' never copies half
    local tmp=$out/.$2.parts n
    rm -rf "$tmp" && mkdir -p "$tmp"
    (cd "$1" && find . \( -name '*.cubin' -o -name '*.json' \) -not -path './tmp.*' | tar czf - -T -) \
        | split -b 15000000 -d -a 2 - "$tmp/$2.tgz."
    n=$(find "$tmp" -type f | wc -l)
    rm -f "$out/$2".tgz*
    if [ "$n" -gt "$3" ]; then
        echo "$2: $(cat "$tmp"/* | wc -c) bytes, over $3 parts of 15 MB: not kept"
    elif [ "$n" = 1 ]; then
        mv "$tmp/$2.tgz.00" "$out/$2.tgz"
    else
        mv "$tmp"/* "$out"/
    fi
    rm -rf "$tmp"
}
tuned_here() {  # DIR: autotuning's choices carried into the Triton cache DIR kept where they were made on this
    # kind of GPU (DIR/gpu.json names it; none: unknown), dropped elsewhere (fla then autotunes anew: an H100's
    # choices would time fla on an H200 with configs chosen for another card); DIR/gpu.json then names this one
    local here there
    here=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    there=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["gpu"])' "$1/gpu.json" 2>/dev/null)
    if [ "$here" != "$there" ] && [ -n "$(find "$1" -name '*.autotune.json' | head -n 1)" ]; then
        find "$1" -name '*.autotune.json' -delete
        echo "autotuning's choices carried from ${there:-an unnamed GPU}, not this ${here:-unnamed one}: dropped"
    fi
    printf '{"gpu": "%s"}\n' "$here" > "$1/gpu.json"
}
cache_in() {  # NAME DIR: .carry/tcache/NAME.tgz (or its parts, joined), made by cache_out, unpacked into DIR
    local parts
    parts=$(ls .carry/tcache/"$1".tgz .carry/tcache/"$1".tgz.[0-9][0-9] 2>/dev/null)
    [ -z "$parts" ] && return 0
    # shellcheck disable=SC2086  # the parts' names: words
    cat $parts | tar xzf - -C "$2" && echo "$1: $(find "$2" -name '*.cubin' | wc -l) compiled kernels carried in"
}
ablating() {  # a variant of 'ablate' is still training or being measured
    pgrep -f "scripts/ablate.sh .*/aruns" > /dev/null
}
cuda_ptxas() {  # the CUDA toolkit's ptxas (12.9 or newer) where there is one: with Triton 3.6's own (12.8) the kda
    # target's backward falls back to the chunkwise PyTorch form (linearize.ops.triton.kda_bwd); found as the
    # package finds it (linearize.ops.triton.ptxas.toolkit_ptxas: $CUDA_HOME/bin, /usr/local/cuda/bin)
    [ -z "${TRITON_PTXAS_PATH:-}" ] || return 0
    local p
    p=$(python3 -c 'from linearize.ops.triton.ptxas import toolkit_ptxas; print(toolkit_ptxas() or "")') \
        || { echo "warning: linearize.ops.triton.ptxas not importable here: Triton's own ptxas stays" >&2; return 0; }
    if [ -n "$p" ]; then
        export TRITON_PTXAS_PATH=$p
    else
        echo "warning: no CUDA toolkit ptxas of 12.9+ found: Triton's own ptxas stays" >&2
    fi
}
gemma_eval() {  # the options of `linearize eval` for the Gemma runs and the teacher (the test split where there is one)
    echo "--eval-data $w/ev --corpus $w/corpus_gemma --corpus-split $(bash scripts/recover_smollm2.sh --corpus-split \
"$w/corpus_gemma") ${GEMMA_EVAL:---limit 500 --batch-size 64 --seq-len 2048 --ppl-tokens 65536 --passkey --passkey-len 2048 --dtype bfloat16}"
}
gemma_mmlu() {  # MODEL OUTPUT: MMLU (GEMMA_MMLU=1) as the SmolLM2 runs measure it, in what is left before DEADLINE
    local left='$(( DEADLINE - ($(date +%s) - START) ))'  # one line: the caller runs it with bash -c
    echo "[ \"\${GEMMA_MMLU:-0}\" = 1 ] || exit 0; [ -f $2 ] || [ $left -lt 120 ] || timeout --signal=INT --kill-after=20 \
\$(( $left - 20 )) python3 -m linearize eval -m $1 $(MMLU_BATCH=16 bash scripts/recover_smollm2.sh --mmlu-options "$w") -o $2"
}
gemma_run() {  # NAME OVERRIDES DEADLINE: the Gemma recipe as run NAME under W/gruns, in the background (then MMLU)
    local g=$w/gemma
    (cd "$repo" && export START=$(date +%s) DEADLINE=$3 GEMMA_MMLU=${GEMMA_MMLU:-0} && EVAL_SECONDS=240 EVAL="$(gemma_eval)" \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True COMMON="teacher.model=$g/gemma-3-270m-q4_k_m.gguf \
data.source=corpus:$w/corpus_gemma" setsid nohup bash -c "bash scripts/ablate.sh \"\$@\"; $(gemma_mmlu \
        "$w/gruns/$1/model" "$w/gruns/$1/quality_mmlu.json")" _ "$(cat "$w/gemma_recipe")" "$w/gruns" "$1=$2" \
        >> "$w/gemma.log" 2>&1 < /dev/null &)
}
gemma_training() {  # a Gemma run's ablate.sh (or its MMLU after it) is alive (its launching shell is gone by then)
    pgrep -f "scripts/ablate.sh .*gemma3.*/gruns" > /dev/null
}
gemma_running() {  # that, or the teacher's evaluation
    gemma_training || pgrep -f "gemma_teacher" > /dev/null
}
# the GPU tests 'kernels' and 'gpu-tests' run unless told others: those of the latest changes to the prefill,
# decoding and evaluation paths (the mix kernel, the fused front's prefill and its default, the harness's fitted
# batch, the fused norms and MLPs and the decoders that now run them)
gpu_tests="mix_triton_gpu or on_the_kernels or fused_front_on_gpu or without_gradients_on_gpu or chunked or fitted_to_memory_on_gpu \
or rms_norm_kernel_on_gpu or fused_norms_on_gpu or silu_mul_kernel_on_gpu or fused_mlps_on_gpu or eager_path_on_gpu or generate_on_gpu"
case ${1:-} in
    gpu-tests)
        [ -d "$repo/linearize" ] || die "run 'teacher' first: it copies the repo the tests import"
        [ -d .carry/pytest ] || die "carry .carry/pytest"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .carry/pytest/*.whl
        rm -rf "$repo/tests" && cp -r tests "$repo"/ && cp pyproject.toml "$repo"/
        cuda_ptxas
        (cd "$repo" && TRITON_INTERPRET=0 setsid nohup bash -c 'python3 -m pytest -v -rfE -p no:cacheprovider \
            --continue-on-collection-errors -m gpu -k "$0" tests/; echo "== gpu tests ended: exit $?"' "${2:-$gpu_tests}" \
            > "$w/gpu_tests.log" 2>&1 < /dev/null &)
        sleep 5
        tail -n 2 "$w/gpu_tests.log" ;;
    wheels)  # .carry/w with .carry/g1, or, where the tree makes that pass 64 MiB, each in its own call
        [ -d .carry/g1 ] || [ -d .carry/w ] || die "no .carry/g1 or .carry/w here: carry them"
        mkdir -p "$w" "$site"
        [ ! -d .carry/g1 ] || cp .carry/g1/* "$w"/
        [ ! -d .carry/g2 ] || cp .carry/g2/gguf.part01 "$w"/  # carried beside .carry/w: 'teacher' finds it here
        if [ -d .carry/w ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .carry/w/*.whl
            python3 -c "import datasets, omegaconf, gguf; print('wheels in', '$site')"
        fi
        ls "$w" ;;
    lm-eval)
        ls .whl/*.whl > /dev/null 2>&1 || die "no .whl here: carry it"
        # the wheels 'wheels' installed stay: replacing a package under a running process could break it
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            $(ls .whl/*.whl | grep -vE '/(datasets|dill|multiprocess|omegaconf|gguf)-') 2>&1 | grep -v "already exists"
        python3 -c "import lm_eval; print('lm_eval', lm_eval.__version__)" ;;
    teacher)
        [ -f "$w/gguf.part00" ] || die "no $w/gguf.part00: run 'wheels' first, on the same machine"
        [ ! -e "$w/recover.log" ] || die "the runs have started: replacing $repo or the teacher under them would break them"
        part=.carry/g2/gguf.part01
        [ -f "$part" ] || part=$w/gguf.part01  # 'wheels' copied it there
        [ -f "$part" ] || die "no .carry/g2 here: carry it (or with .carry/w to 'wheels')"
        python3 -c "import lm_eval" 2> /dev/null || die "no lm-eval here: run 'lm-eval' (carry .whl) first"
        cat "$w/gguf.part00" "$part" > "$w/smollm2.gguf.part" && mv "$w/smollm2.gguf.part" "$w/smollm2.gguf"
        rm -rf "$repo" && mkdir -p "$repo" && cp -r linearize recipes scripts pyproject.toml "$repo"/
        echo "teacher in $w/smollm2.gguf, the repo in $repo" ;;
    start)
        src=${2:-} deadline=${3:-1200}
        [ -f "$src/manifest.json" ] || die "$src is no corpus folder: carry .carry/corpus25 (or .carry/corpus) and name it"
        [ -f "$w/smollm2.gguf" ] && [ -d "$repo" ] || die "run 'wheels' and 'teacher' first, on the same machine"
        [ ! -e "$w/recover.log" ] || die "the runs have started already ($w/recover.log): 'wait' for them"
        rm -rf "$w/corpus" && cp -r "$src" "$w/corpus"
        [ ! -d "$w/corpus.parts" ] || cp -r "$w/corpus.parts/." "$w/corpus/"
        missing=$(python3 -c "import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); m = json.loads((d / 'manifest.json').read_text())
print(' '.join(s['file'] for dom in m['domains'].values() for split in dom.values() for s in split['shards'] if not (d / s['file']).is_file()))" "$w/corpus")
        [ -z "$missing" ] || { rm -rf "$w/corpus"; die "the corpus lacks $missing: carry its parts with 'corpus-part' first"; }
        (cd "$repo" && setsid nohup bash scripts/recover_smollm2.sh "$w" "$w/out" "$deadline" > "$w/recover.log" 2>&1 < /dev/null &)
        sleep 20
        records ;;
    corpus-part)
        src=${2:-}
        ls "$src"/*/train-*.safetensors > /dev/null 2>&1 || die "no training shards in '$src': carry .carry/corpus_2 (… _3) and name it"
        mkdir -p "$w/corpus.parts" && cp -r "$src/." "$w/corpus.parts/" && du -sh "$w/corpus.parts" ;;
    evaldata)
        [ -d .carry/ev/hf_datasets ] || die "no .carry/ev here: carry it"
        [ ! -d "$w/ev" ] || die "$w/ev is there already"
        rm -rf "$w/ev.part" && cp -r .carry/ev "$w/ev.part" && mv "$w/ev.part" "$w/ev"  # whole, at once
        records ;;
    wait)
        limit=${2:?wait needs SECONDS}
        for _ in $(seq 1 $(( limit / 5 ))); do
            running "$w/recover.pid" || gemma_running || ablating || { echo "== the runs are not running"; break; }
            sleep 5
        done
        records ;;
    ablate)
        deadline=${2:?ablate needs DEADLINE and NAME=OVERRIDES}
        shift 2
        [ $# -ge 1 ] || die "ablate needs at least one NAME=OVERRIDES"
        [ -f "$w/smollm2.gguf" ] && [ -f "$w/corpus/manifest.json" ] || die "run 'wheels', 'teacher' and 'start' first"
        recipe=${ABLATE_RECIPE:-recipes/smollm2-135m-gdn-corpus.yaml}
        cuda_ptxas
        eval_opts=$(bash scripts/recover_smollm2.sh --eval-options "$w")  # the recovery runs' and their teacher's
        for spec in "$@"; do [ "${spec#*=}" != "$spec" ] || die "'$spec' is no NAME=OVERRIDES"; done
        # one lane per 40 GiB of GPU memory (a distill run of the recipe holds ~35 GiB, its evaluation at batch 64
        # ~44: three lanes on an 80 GiB H100 ran out of memory), at most one per variant
        mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1)
        lanes=${ABLATE_LANES:-$(( ${mem:-40960} / 40960 ))}
        (( lanes >= 1 )) || lanes=1
        (( lanes <= $# )) || lanes=$#
        for (( lane = 0; lane < lanes; lane++ )); do  # lane i: variants i, i + lanes, …, one after the other
            mine=()
            for (( i = lane; i < $#; i += lanes )); do mine+=("${@:i+1:1}"); done
            [ ${#mine[@]} -gt 0 ] || continue
            # each variant measured as soon as it is trained when the task data is there ('evaldata' may
            # come later); the last ablate.sh waits for the data and measures the ones still unmeasured (it
            # finds them trained), as recover_smollm2.sh does
            (cd "$repo" && export START=$(date +%s) DEADLINE=$deadline PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
                COMMON="teacher.model=$w/smollm2.gguf data.source=corpus:$w/corpus" && setsid nohup bash -c \
                'for v in "${@:4}"; do if [ -d "$2/hf_datasets" ]; then EVAL="$3" bash scripts/ablate.sh "$0" "$1" "$v"
                else bash scripts/ablate.sh "$0" "$1" "$v"; fi; done
                until [ -d "$2/hf_datasets" ] || [ $(( $(date +%s) - START )) -gt $(( DEADLINE - 300 )) ]; do sleep 10; done
                EVAL="$3" bash scripts/ablate.sh "$0" "$1" "${@:4}"' \
                "$recipe" "$w/aruns" "$w/ev" "$eval_opts" "${mine[@]}" >> "$w/ablate_${mine[0]%%=*}.log" 2>&1 < /dev/null &)
        done
        sleep 5
        records ;;
    fla)
        [ -d .carry/fla ] || die "no .carry/fla here: carry it"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .carry/fla/*.whl
        python3 -c "import fla; print('fla', fla.__version__)" ;;
    kernels)
        ops=${2:-linear gdn} shapes=${3:-2x8192,1x16384,1x32768} tests=${4:-$gpu_tests}
        [ "$shapes" = all ] && shapes=std,smollm2,llama3-8b
        [ "$ops" = none ] && ops=""  # the tests alone
        [ -d .carry/fla ] && [ -d .carry/pytest ] || die "carry .carry/fla and .carry/pytest"
        # .carry/w carried too: the training wheels in the same call (no 'wheels' call before)
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .carry/fla/*.whl .carry/pytest/*.whl \
            $(ls .carry/w/*.whl 2>/dev/null)
        export TRITON_INTERPRET=0 TRITON_CACHE_DIR=$w/triton-cache TRITON_CACHE_AUTOTUNING=1
        mkdir -p "$TRITON_CACHE_DIR"
        [ -f .carry/tcache/autotune.tgz ] && tar xzf .carry/tcache/autotune.tgz -C "$TRITON_CACHE_DIR"
        cache_in bench_kernels "$TRITON_CACHE_DIR"
        tuned_here "$TRITON_CACHE_DIR"
        cuda_ptxas
        if [ "${AB:-0}" = 1 ]; then  # first the A/B of the trees scripts/ab.sh made (carry ab), without fla
            [ -d ab ] || die "AB=1: carry ab (scripts/ab.sh trees REV ... makes it)"
            for op in ${AB_OPS:-$ops}; do
                # shellcheck disable=SC2086  # BENCH_FLAGS: words
                bash scripts/ab.sh run 200 "$out/ab_$op" bench_kernels.py --op "$op" --no-fla --only "${AB_SHAPES:-$shapes}" \
                    ${BENCH_FLAGS:-} 2>&1 | grep -v Warn | tail -n 24
            done
        fi
        if [ -n "${AB_FLAGS:-}" ]; then  # a switch A/B in this tree: each of AB_FLAGS' ';'-separated flag sets
            IFS=';' read -ra sets <<< "$AB_FLAGS"
            for op in ${AB_OPS:-$ops}; do
                for (( r = 1; r <= ${AB_ROUNDS:-1}; r++ )); do  # rounds interleave the flag sets, as ab.sh's trees
                    for flags in "${sets[@]}"; do
                        tag=$(echo "${flags:-default}" | tr -c 'A-Za-z0-9\n' _ | sed 's/^_*//')
                        [ "${AB_ROUNDS:-1}" = 1 ] || tag="$tag.r$r"
                        echo "== $op $flags"
                        # shellcheck disable=SC2086  # flags: words
                        timeout 200 python3 scripts/bench_kernels.py --op "$op" --no-fla --only "${AB_SHAPES:-$shapes}" \
                            $flags --output "$out/ab_$op/$tag.json" 2>&1 | grep -v Warn | tail -n 6
                    done
                done
            done
        fi
        if [ "${AB:-0}" = 1 ] || [ -n "${AB_FLAGS:-}" ]; then  # the trees' and flag sets' medians, one table per
            for op in ${AB_OPS:-$ops}; do                       # operator beside the base's, in the log
                python3 scripts/ab_table.py "$out/ab_$op"
            done
        fi
        # the GPU tests' time is the compiler's (the kda tests: 705 s in one process on an H100): pytest-xdist,
        # where .carry/pytest brings it, spreads them over TEST_WORKERS processes (default 8) of the 16 cores
        workers=$(python3 -c 'import xdist' 2> /dev/null && echo "-n ${TEST_WORKERS:-8}")
        gpu_tests() {  # a module needing a package the machine lacks does not stop the rest
            # the tests' kernels compiled into a cache of their own, which comes back as OUT/test_kernels.tgz*
            # (cache_out) and, carried in .carry/tcache, spares a later run of unchanged kernels the compiling
            local cache=$w/test-cache
            mkdir -p "$cache"
            cache_in test_kernels "$cache"
            # shellcheck disable=SC2086  # workers: words
            # -v: each test's outcome in the log as it ends (a call cut off still shows which failed)
            TRITON_CACHE_DIR=$cache python3 -m pytest -v -rfE -p no:cacheprovider $workers --continue-on-collection-errors \
                -m gpu -k "$tests" tests/ > "$out/gpu_tests.log" 2>&1
            tail -n 3 "$out/gpu_tests.log"
            cache_out "$cache" test_kernels 2
            # a -k that matches nothing still ends "N skipped" (the modules skipped at collection): say so
            grep -qE "[0-9]+ (passed|failed)" "$out/gpu_tests.log" \
                || echo "warning: -k \"$tests\" ran no GPU test (parametrized dtypes' ids are dtype0, dtype1, …)"
        }
        # EARLY_TESTS=1: the tests before the tables against fla (which outlast a call), after the A/Bs
        [ "${EARLY_TESTS:-0}" = 1 ] && [ "$tests" != skip ] && gpu_tests
        for op in $ops; do
            # shellcheck disable=SC2086  # BENCH_FLAGS: words
            python3 scripts/bench_kernels.py --op "$op" --only "$shapes" ${BENCH_FLAGS:-} \
                --output "$out/bench_$op${BENCH_TAG:-}.json" 2>&1 | tail -n 12
            (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -o -name gpu.json | tar czf "$out/autotune.tgz" -T -)
            cache_out "$TRITON_CACHE_DIR" bench_kernels 3  # after each operator: a run cut off keeps what it compiled
        done
        [ -z "$ops" ] || echo "Triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1), $(tar tzf "$out/autotune.tgz" | grep -c autotune.json) \
autotuned kernels kept"
        for op in ${PROFILE_OPS:-}; do  # then where each operator's time goes, ours and fla's, kernel by kernel
            timeout 300 python3 scripts/profile_kernels.py --op "$op" --shapes "${PROFILE_SHAPES:-2x8192}" \
                --output "$out/profile_$op.json" 2>&1 | grep -v Warn | tail -n 30
        done
        if [ -n "${AB_TESTS:-}" ]; then  # the candidates' own GPU tests, each tree's on its kernels
            [ -d ab ] || die "AB_TESTS: carry ab (scripts/ab.sh trees REV ... makes it)"
            # shellcheck disable=SC2086  # workers: words
            TRITON_CACHE_DIR=$w/ab-test-cache bash scripts/ab.sh test "$out/ab_tests" -q -rfE -m gpu -k "$AB_TESTS" $workers
        fi

        [ "$tests" = skip ] || [ "${EARLY_TESTS:-0}" = 1 ] || gpu_tests ;;
    kernels-start)
        shift
        k=$w/kernels
        [ ! -e "$k/step.log" ] || [ -e "$k/done" ] || die "a kernels step runs already: 'kernels-wait' for it"
        mkdir -p "$k" && rm -f "$k/done"
        (OUT=$k setsid nohup bash -c 'bash scripts/device_calls.sh kernels "$@"; echo "exit $?" > "$OUT/done"' _ "$@" \
            > "$k/step.log" 2>&1 < /dev/null &)
        sleep 5; tail -n 5 "$k/step.log" ;;
    kernels-wait)
        k=$w/kernels end=$(( $(date +%s) + ${2:-540} ))
        [ -e "$k/step.log" ] || die "no kernels step: 'kernels-start' first"
        while [ "$(date +%s)" -lt "$end" ] && [ ! -e "$k/done" ]; do sleep 5; done
        tar czf "$out/kernels.tgz" -C "$k" --exclude='autotune.tgz' --exclude='*_kernels.tgz*' --exclude='.*.parts' .
        cp "$k/autotune.tgz" "$k"/*_kernels.tgz* "$out"/ 2>/dev/null
        tail -n 40 "$k/step.log"
        if [ -e "$k/done" ]; then cat "$k/done"; else echo "still running: call 'kernels-wait' again"; fi ;;
    gemma-part)
        src=${2:-}
        [ -d "$src" ] && ls "$src"/gguf.part0? >/dev/null 2>&1 || die "no teacher part in '$src': carry .carry/gm1, gm2 …"
        mkdir -p "$w/gemma" "$site" && cp "$src"/gguf.part0? "$w/gemma"/
        if [ -d .whl ]; then
            [ -d .carry/w ] || die "carry .carry/w (the training wheels) with .whl"
            python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl .carry/w/*.whl 2>&1 | grep -v "already exists"
            [ -d "$repo" ] || { mkdir -p "$repo" && cp -r linearize recipes scripts pyproject.toml "$repo"/; }
        fi
        ls "$w/gemma" ;;
    gemma-start)
        deadline=${2:-1200} steps=${3:-600} g=$w/gemma
        last=$(dirname "$(ls .carry/gm*/SHA256SUMS 2> /dev/null | head -n 1)")
        [ -f "$last/SHA256SUMS" ] || die "no last Gemma part (.carry/gmN with SHA256SUMS) here: carry it"
        [ -d "$repo" ] || die "no $repo: carry .whl with .carry/gm1 ('gemma-part') first"
        [ ! -e "$w/gemma.log" ] || die "the Gemma run has started already: 'wait' for it"
        cp "$last"/* "$g"/ && (cd "$g" && cat gguf.part0? > gemma-3-270m-q4_k_m.gguf && rm gguf.part0? \
            && sha256sum -c --quiet SHA256SUMS && python3 -m tarfile -e tokenizer.tar.xz . \
            && python3 -m tarfile -e corpus_gemma.tar.xz "$w" && { [ -d "$w/ev" ] || python3 -m tarfile -e ev.tar.xz "$w"; }) \
            2> >(grep -v -i "deprecat\|warnings.warn" >&2) || die "the Gemma parts do not join: carry the others with 'gemma-part' first"
        echo "${GEMMA_RECIPE:-recipes/gemma3-270m-gdn-25m.yaml}" > "$w/gemma_recipe"
        gemma_run "G$steps${GEMMA_TAG:-}" "stages.1.steps=$steps ${GEMMA_EXTRA:-}" "$deadline"
        # shellcheck disable=SC2086  # the options are words
        [ "${GEMMA_TEACHER:-1}" = 0 ] || (cd "$repo" && export START=$(date +%s) DEADLINE=$deadline \
            GEMMA_MMLU=${GEMMA_MMLU:-0} && setsid nohup bash -c "python3 -m linearize eval -m $g/gemma-3-270m-q4_k_m.gguf \
            --teacher none $(gemma_eval) -o $w/gemma_teacher.json; $(gemma_mmlu "$g/gemma-3-270m-q4_k_m.gguf" \
            "$w/gemma_teacher_mmlu.json")" > "$w/gemma_teacher.log" 2>&1 < /dev/null &)
        sleep 5
        records ;;
    gemma-more)
        name=${2:?gemma-more needs NAME} deadline=${4:-1200}
        [ -f "$w/gemma/gemma-3-270m-q4_k_m.gguf" ] || die "no joined Gemma teacher: run 'gemma-start' first"
        ! gemma_training || die "a Gemma run is still going: 'wait' for it (one at a time fits in memory)"
        [ -z "${GEMMA_RECIPE:-}" ] || echo "$GEMMA_RECIPE" > "$w/gemma_recipe"
        gemma_run "$name" "${3:-}" "$deadline"
        sleep 5
        records ;;
    relay-out)
        run=${2:?relay-out needs RUN, a folder of W/runs} rel=$w/relay_out
        if [ ! -f "$rel/$run.sha256" ]; then
            ckpt=$(ls "$w/runs/$run"/checkpoints/step_*.pt 2> /dev/null | sort | tail -n 1)  # written whole, renamed
            [ -n "$ckpt" ] || [ -f "$w/runs/$run/model/config.json" ] || die "no checkpoint or model in $w/runs/$run"
            pkill -f "[r]ecover_smollm2.sh"; pkill -f "[s]cripts/ablate.sh"; pkill -INT -f "[l]inearize (distill|eval)"
            for _ in $(seq 1 60); do pgrep -f "[l]inearize (distill|eval)" > /dev/null || break; sleep 1; done
            if [ -f "$w/runs/$run/model/config.json" ]; then  # trained: the model (a sixth of a checkpoint) to measure
                what="$run/model"  # next time, whose evaluations 'start' then runs ('start' skips a trained run)
            else
                ckpt=$(ls "$w/runs/$run"/checkpoints/step_*.pt | sort | tail -n 1)  # one may have come since
                what="${ckpt#"$w"/runs/}"
            fi
            mkdir -p "$rel/sent" && (cd "$w/runs" && { find "$run" \( -path "$run/model*" -o -path "$run/tensorboard" \
                -o -path "$run/checkpoints" \) -prune -o -type f -print; [ -f "$what" ] && echo "$what" || find "$what" \
                -type f; } | tar cf - -T - | split -b 15M -d -a 3 - "$rel/$run.tar.") && (cd "$rel" && sha256sum \
                "$run".tar.* > "$run.sha256.part" && mv "$run.sha256.part" "$run.sha256") || die "could not pack $w/runs/$run"
            echo "$run packed ($what): $(wc -l < "$rel/$run.sha256") parts"
        fi
        n=0
        for part in "$rel/$run".tar.*; do  # four parts (60 MiB) and the checksums: under a call's 64 MiB back
            [ ! -e "$rel/sent/${part##*/}" ] && [ $n -lt 4 ] || continue
            cp "$part" "$out"/ && touch "$rel/sent/${part##*/}" && n=$(( n + 1 ))
        done
        cp "$rel/$run.sha256" "$out"/
        echo "$(ls "$rel/sent" | wc -l) of $(wc -l < "$rel/$run.sha256") parts sent" ;;
    relay-in)
        src=${2:-}
        sums=$(ls "$src"/*.sha256 2> /dev/null | head -n 1)
        [ -f "$sums" ] || die "no checksums in '$src': carry a .carry/relayN that scripts/device_relay.sh split made"
        [ ! -e "$w/recover.log" ] || die "the runs have started: relay a run in before 'start'"
        run=$(basename "$sums" .sha256)
        mkdir -p "$w/relay_in" "$w/runs" && cp "$src"/* "$w/relay_in"/
        if (cd "$w/relay_in" && sha256sum -c --quiet "$run.sha256" > /dev/null 2>&1); then
            cat "$w/relay_in/$run".tar.* | tar xf - -C "$w/runs" && rm -rf "$w/relay_in" || die "could not unpack $run"
            echo "$run in $w/runs: $(ls "$w/runs/$run/checkpoints" 2> /dev/null || echo "model/, trained")"
        else
            echo "$(ls "$w/relay_in/$run".tar.* | wc -l) of $(wc -l < "$sums") parts of $run here"
        fi ;;
    *) die "unknown step '${1:-}'" ;;
esac
