#!/usr/bin/env bash
# A/B runs over git revisions in one GPU call. The device gets a copy of the working tree without .git,
# so the trees are made here:
#   scripts/ab_trees.sh REV...
# writes ab/<name>/ for each REV (name: the REV with / replaced by _): that revision's linearize/ and
# today's scripts/ (the scripts import the linearize/ next to them). Then, on the device (carry "ab"):
#   for t in ab/*/; do python "$t/scripts/bench_distill.py" --variants --output "$OUT/$(basename "$t").json"; done
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/ab_trees.sh REV [REV ...]  (git revisions to compare)" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
for rev in "$@"; do
    git -C "$root" rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "not a git revision: $rev" >&2; exit 2; }
done
rm -rf "$root/ab"
for rev in "$@"; do
    dir="$root/ab/${rev//\//_}"
    mkdir -p "$dir"
    git -C "$root" archive "$rev" linearize | tar -x -C "$dir"
    cp -r "$root/scripts" "$dir/"
    echo "$dir: linearize/ of $(git -C "$root" rev-parse --short "$rev") ($rev), today's scripts/"
done
