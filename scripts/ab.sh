#!/usr/bin/env bash
# A/B runs over git revisions in one GPU call. The device gets a copy of the working tree without .git, so
# the trees are made here and the runs there:
#   scripts/ab.sh trees REV...                       (here) ab/<name>/ per REV: its linearize/, today's scripts/
#   scripts/ab.sh run LIMIT_S OUT_DIR SCRIPT [ARGS]  (there, carry "ab") SCRIPT in every tree in turn, each with
#                                                    its own time limit, writing OUT_DIR/<tree>.<script>.json
# e.g. scripts/ab.sh run 150 "$OUT" bench_kernels.py --no-fla --only 1x16384,llama3-8b
set -uo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
root=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  trees)
    shift
    [ $# -ge 1 ] || { echo "usage: scripts/ab.sh trees REV [REV ...]  (git revisions to compare)" >&2; exit 2; }
    for rev in "$@"; do
        git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "not a git revision: $rev" >&2; exit 2; }
    done
    rm -rf "$root/ab"
    for rev in "$@"; do
        dir="$root/ab/${rev//\//_}"
        mkdir -p "$dir"
        git -C "$root" archive "$rev" linearize | tar -x -C "$dir" || exit 1
        cp -r "$root/scripts" "$dir/"
        echo "$dir: linearize/ of $(git -C "$root" rev-parse --short "$rev") ($rev), today's scripts/"
    done ;;
  run)
    shift
    [ $# -ge 3 ] || { echo "usage: scripts/ab.sh run LIMIT_S OUT_DIR SCRIPT [ARGS ...]" >&2; exit 2; }
    limit=$1 out=$2 script=$3
    shift 3
    [ -d "$root/ab" ] || { echo "no ab/ folder: run scripts/ab.sh trees REV... first (and carry ab)" >&2; exit 2; }
    mkdir -p "$out"
    for tree in "$root"/ab/*/; do
        name=$(basename "$tree")
        echo "== $name: $script $* (limit ${limit}s)"
        timeout "$limit" python "$tree/scripts/$script" "$@" --output "$out/$name.${script%.py}.json"
        echo "== exit $?"
    done ;;
  *) usage >&2; exit 2 ;;
esac
