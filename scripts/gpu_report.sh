#!/usr/bin/env bash
# Every GPU measurement of the project, most needed first, each step under its own time limit and each
# writing its files as it goes (a step cut short keeps what it measured). Steps:
#   tests    the GPU tests (pytest -m gpu): kernels against float64 references; JUnit XML in OUT/gpu_tests.xml
#   kernels  ours vs flash-linear-attention and SDPA, every shape (bench_kernels.json/.md); the linear target's
#            operator vs fla's chunk_simple_gla (bench_kernels_linear.json/.md); the kda target's vs fla's
#            chunk_kda (bench_kernels_kda.json/.md)
#   profile  GPU time per kernel, ours and fla (profile_kernels.json)
#   ncu      Nsight Compute on each forward kernel at 2x8192 (ncu_forward_2x8192.json)
#   distill  align/distill throughput against the teacher, rows and packed, both fronts (bench_distill_variants.json)
#   decode   decoding against the teacher's generate() and static + compile paths, the graph decoder plain,
#            compiled, and a hybrid of 8 softmax layers; SmolLM2 architecture, random weights unless
#            DECODE_MODEL names a checkpoint; then the prompt prefilled 8192 tokens at a time (bench_decode.json,
#            bench_decode_compiled.json, bench_decode_hybrid.json, bench_decode_chunked.json); the prefill
#            against the teacher's SDPA prefill, with the kernels of one 32K prefill (bench_prefill.json)
#   quality  with TEACHER and DATA: the GPU recipe end to end, then its quality table (quality/run, quality_gpu.json)
# e.g. scripts/gpu_report.sh out smollm2-135m data/python-docs.jsonl
#      scripts/gpu_report.sh --only quality out smollm2-135m data/python-docs.jsonl stages.0.steps=20
set -uo pipefail
usage="usage: scripts/gpu_report.sh [-h] [--only STEP,...] [--recipe RECIPE.yaml] OUT_DIR [TEACHER DATA.jsonl [key=value ...]]"
all="tests,kernels,profile,ncu,distill,decode,quality"
only=$all
recipe=recipes/smollm2-135m-gdn-gpu.yaml
die() { echo "error: $1 (scripts/gpu_report.sh -h: usage)" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) echo "$usage"; sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --only) [ $# -ge 2 ] || die "--only needs a list of steps ($all)"; only=$2; shift 2 ;;
        --recipe) [ $# -ge 2 ] || die "--recipe needs a recipe file"; recipe=$2; shift 2 ;;
        -*) die "unknown option $1" ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] || die "OUT_DIR is missing"
for s in ${only//,/ }; do
    case ",$all," in *",$s,"*) ;; *) die "unknown step '$s' in --only (steps: $all)" ;; esac
done
[ -f "$recipe" ] || die "recipe $recipe not found (pass --recipe PATH)"
out=$1
shift
teacher=${1:-} data=${2:-}
[ $# -ge 2 ] && shift 2 || shift $#
if [ -n "$teacher" ] && [ -z "$data" ]; then die "TEACHER given without DATA.jsonl"; fi
if [ -n "$data" ] && [ ! -f "$data" ]; then die "data file $data not found (scripts/pydocs_corpus.py builds data/python-docs.jsonl)"; fi
mkdir -p "$out"
wanted() { case ",$only," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "== exit $?"; }

wanted tests && step 600 env TRITON_INTERPRET=0 python -m pytest -m gpu -q --junitxml "$out/gpu_tests.xml"
wanted kernels && step 540 python scripts/bench_kernels.py --output "$out/bench_kernels.json" --markdown "$out/bench_kernels.md"
wanted kernels && step 300 python scripts/bench_kernels.py --op linear --output "$out/bench_kernels_linear.json" \
    --markdown "$out/bench_kernels_linear.md"
wanted kernels && step 300 python scripts/bench_kernels.py --op kda --output "$out/bench_kernels_kda.json" \
    --markdown "$out/bench_kernels_kda.md"
wanted profile && step 240 python scripts/profile_kernels.py --output "$out/profile_kernels.json"
wanted ncu && step 200 python scripts/profile_ncu.py --output "$out/ncu_forward_2x8192.json"
wanted distill && step 240 python scripts/bench_distill.py --variants --output "$out/bench_distill_variants.json"
if wanted decode; then
    dm=()
    [ -n "${DECODE_MODEL:-}" ] && dm=(--model "$DECODE_MODEL")
    step 300 python scripts/bench_decode.py "${dm[@]}" --contexts 32768 2048 8192 65536 --batches 16 1 64 \
        --check-prompts 20 --output "$out/bench_decode.json" --plot "$out/bench_decode.png"
    step 200 python scripts/bench_decode.py "${dm[@]}" --contexts 32768 2048 --batches 16 1 --compile \
        --output "$out/bench_decode_compiled.json"
    step 150 python scripts/bench_decode.py "${dm[@]}" --contexts 32768 2048 --batches 16 1 --keep-softmax 8 \
        --check-prompts 20 --output "$out/bench_decode_hybrid.json"
    step 150 python scripts/bench_decode.py "${dm[@]}" --contexts 65536 32768 8192 --batches 16 --prefill-chunk 8192 \
        --output "$out/bench_decode_chunked.json"
    step 200 python scripts/bench_prefill.py "${dm[@]}" --contexts 8192 32768 65536 --batches 1 16 --profile 32768x1 \
        --output "$out/bench_prefill.json"
fi
if wanted quality; then
    if [ -z "$teacher" ]; then
        echo "== quality skipped: give TEACHER and DATA.jsonl"
    else
        start=$(date +%s.%N)
        step 400 python -m linearize distill "$recipe" teacher.model="$teacher" data.source="$data" \
            output.dir="$out/quality/run" "$@"
        end=$(date +%s.%N)
        python scripts/quality_table.py "$out/quality/run" --wall-s "$(python -c "print($end - $start)")" \
            --output "$out/quality_gpu.json"
    fi
fi
