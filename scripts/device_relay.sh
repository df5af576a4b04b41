#!/usr/bin/env bash
# A training run longer than one session's device time, carried from one GPU machine to the next through this
# one: `scripts/device_calls.sh relay-out RUN` sends its newest checkpoint and records back in parts (four a
# call), this script gathers and checks them, then cuts them into carry folders for `relay-in` on the next
# machine, which unpacks the run where 'start' resumes it (resumed, a run equals an uninterrupted one).
#   scripts/device_relay.sh gather RUN DIR       the parts the relay-out calls brought back (the device tool's
#                                                folders, DEVICE_FILES, default /work/.device) into DIR, checked
#                                                against RUN.sha256
#   scripts/device_relay.sh split RUN DIR [N]    DIR's parts into .carry/relay1, relay2 … (N parts each, default
#                                                3: 45 MiB beside the working tree under a call's 64 MiB), each
#                                                with RUN.sha256; then carry them one a call: relay-in .carry/relayK
set -uo pipefail
die() { echo "error: $1 (scripts/device_relay.sh: see its header)" >&2; exit 2; }
[ $# -ge 3 ] || die "usage: scripts/device_relay.sh gather|split RUN DIR [N]"
step=$1 run=$2 dir=$3
case $step in
    gather)
        from=${DEVICE_FILES:-/work/.device}
        sums=$(ls -t "$from"/*/"$run.sha256" 2> /dev/null | head -n 1)
        [ -n "$sums" ] || die "no $run.sha256 under $from: run 'relay-out $run' on the device first"
        mkdir -p "$dir" && cp "$sums" "$dir/"
        for part in $(cut -d ' ' -f 3 "$dir/$run.sha256"); do
            [ -f "$dir/$part" ] || { found=$(ls -t "$from"/*/"$part" 2> /dev/null | head -n 1)
                                     [ -z "$found" ] || cp "$found" "$dir/"; }
        done
        missing=$(cd "$dir" && for part in $(cut -d ' ' -f 3 "$run.sha256"); do [ -f "$part" ] || echo "$part"; done)
        [ -z "$missing" ] || die "$(wc -w <<< "$missing") of $(wc -l < "$dir/$run.sha256") parts not back yet \
(first: $(head -n 1 <<< "$missing")): more 'relay-out $run' calls"
        (cd "$dir" && sha256sum -c --quiet "$run.sha256") || die "a part of $run does not match its checksum"
        echo "$run: $(wc -l < "$dir/$run.sha256") parts in $dir, checked" ;;
    split)
        n=${4:-3}
        [ -f "$dir/$run.sha256" ] || die "no $dir/$run.sha256: gather the parts first"
        rm -rf .carry/relay[0-9]*
        k=0 i=0
        for part in $(cut -d ' ' -f 3 "$dir/$run.sha256"); do
            [ $(( i % n )) -ne 0 ] || { k=$(( k + 1 )); mkdir -p ".carry/relay$k" && cp "$dir/$run.sha256" ".carry/relay$k/"; }
            cp "$dir/$part" ".carry/relay$k/" && i=$(( i + 1 ))
        done
        echo "$i parts of $run in .carry/relay1 … relay$k: carry each with 'relay-in .carry/relayK', before 'start'" ;;
    *) die "unknown step '$step'" ;;
esac
