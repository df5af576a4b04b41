#!/usr/bin/env bash
# A/B runs over git revisions in one GPU call. The device gets a copy of the working tree without .git, so
# the trees are made here and the runs there:
#   scripts/ab.sh trees REV...                       (here) ab/<name>/ per REV: its linearize/ and tests/, today's
#                                                    scripts/
#   scripts/ab.sh run LIMIT_S OUT_DIR SCRIPT [ARGS]  (there, carry "ab") SCRIPT in every tree in turn, each with
#                                                    its own time limit, writing OUT_DIR/<tree>.<script>.json;
#                                                    AB_ROUNDS=N: N rounds, the trees interleaved in each
#                                                    (OUT_DIR/<tree>.r<k>.<script>.json), for scripts/ab_table.py
#   scripts/ab.sh test OUT_DIR [PYTEST ARGS]         (there) each tree's tests/ on its linearize/ (AB_TREES: these
#                                                    trees only) into OUT_DIR/<tree>.log, its last line printed;
#                                                    -k also matches the tree's folder name: name the tests
# e.g. scripts/ab.sh run 150 "$OUT" bench_kernels.py --no-fla --only 1x16384,llama3-8b
set -uo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
root=$(cd "$(dirname "$0")/.." && pwd)
need_trees() { [ -d "$root/ab" ] || { echo "no ab/ folder: run scripts/ab.sh trees REV... first (and carry ab)" >&2; exit 2; }; }
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
        git -C "$root" archive "$rev" linearize tests | tar -x -C "$dir" || exit 1
        cp -r "$root/scripts" "$dir/"
        echo "$dir: linearize/ and tests/ of $(git -C "$root" rev-parse --short "$rev") ($rev), today's scripts/"
    done ;;
  run)
    shift
    [ $# -ge 3 ] || { echo "usage: scripts/ab.sh run LIMIT_S OUT_DIR SCRIPT [ARGS ...]" >&2; exit 2; }
    limit=$1 out=$2 script=$3
    shift 3
    need_trees
    rounds=${AB_ROUNDS:-1}
    [[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "AB_ROUNDS must be a positive whole number, not '$rounds'" >&2; exit 2; }
    mkdir -p "$out"
    # the same process twice can differ by 10-20% (clocks): rounds interleave the trees, so a drift
    # falls on every tree alike and the spread across rounds shows what a difference must beat
    for (( r = 1; r <= rounds; r++ )); do
        for tree in "$root"/ab/*/; do
            name=$(basename "$tree")
            [ "$rounds" = 1 ] || name="$name.r$r"
            echo "== $name: $script $* (limit ${limit}s)"
            timeout "$limit" python "$tree/scripts/$script" "$@" --output "$out/$name.${script%.py}.json"
            echo "== exit $?"
        done
    done ;;
  test)
    shift
    [ $# -ge 1 ] || { echo "usage: scripts/ab.sh test OUT_DIR [PYTEST ARGS ...]" >&2; exit 2; }
    out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
    shift
    need_trees
    for tree in "$root"/ab/*/; do
        name=$(basename "$tree")
        [ -z "${AB_TREES:-}" ] || [[ " $AB_TREES " == *" $name "* ]] || continue
        [ -d "$tree/tests" ] || { echo "$tree has no tests/: make the trees again" >&2; exit 2; }
        # run from the tree: its folder heads sys.path, so its linearize/ is the one imported (the log's first line)
        (cd "$tree" && python -c 'import linearize; print("linearize from", linearize.__file__)' \
            && python -m pytest -p no:cacheprovider "$@" tests/) > "$out/$name.log" 2>&1
        rc=$?
        echo "== $name: $(tail -n 1 "$out/$name.log") (exit $rc)"
    done ;;
  *) usage >&2; exit 2 ;;
esac
