#!/usr/bin/env bash
# On the GPU machine: one benchmark script in every tree scripts/ab_trees.sh made (carry "ab"), in turn,
# each run with its own time limit and its own JSON:
#   scripts/gpu_ab.sh LIMIT_S OUT_DIR SCRIPT [ARGS ...]
# e.g. scripts/gpu_ab.sh 150 "$OUT" bench_kernels.py --no-fla --only 1x16384,llama3-8b
# writes OUT_DIR/<tree>.<script>.json (the script's --output).
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: scripts/gpu_ab.sh LIMIT_S OUT_DIR SCRIPT [ARGS ...]" >&2; exit 2; }
limit=$1 out=$2 script=$3
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$root/ab" ] || { echo "no ab/ folder: run scripts/ab_trees.sh REV... first (and carry ab)" >&2; exit 2; }
mkdir -p "$out"
for tree in "$root"/ab/*/; do
    name=$(basename "$tree")
    echo "== $name: $script $* (limit ${limit}s)"
    timeout "$limit" python "$tree/scripts/$script" "$@" --output "$out/$name.${script%.py}.json"
    echo "== exit $?"
done
