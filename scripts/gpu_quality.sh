#!/usr/bin/env bash
# The GPU quality table of issue 5: run recipes/smollm2-135m-gdn-gpu.yaml, then tabulate it.
#   scripts/gpu_quality.sh TEACHER DATA.jsonl OUT_DIR [key=value ...]
# e.g. scripts/gpu_quality.sh smollm2-135m data/python-docs.jsonl out   (writes out/run and out/quality_gpu.json)
set -euo pipefail
teacher=$1 data=$2 out=$3
shift 3
start=$(date +%s.%N)
python -m linearize distill recipes/smollm2-135m-gdn-gpu.yaml teacher.model="$teacher" data.source="$data" \
    output.dir="$out/run" "$@"
end=$(date +%s.%N)
python scripts/quality_table.py "$out/run" --wall-s "$(python -c "print($end - $start)")" --output "$out/quality_gpu.json"
