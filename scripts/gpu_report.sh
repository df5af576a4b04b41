#!/usr/bin/env bash
# Every GPU measurement of issues 4 and 5, most needed first, each with its own time limit, each writing its
# JSON as it goes (a step cut short keeps what it measured):
#   scripts/gpu_report.sh OUT_DIR [TEACHER.gguf DATA.jsonl]
# 1. the kernels' correctness: the fused front, the distill loss kernel, then all 18 operator cases, bf16 before fp32 (fp32 compiles slowly: IEEE products unroll to FMAs)
# 2. kernels against flash-linear-attention and SDPA, every shape
# 3. GPU time per kernel, ours and fla; Nsight Compute on each forward kernel (why it takes that time)
# 4. align/distill throughput against the teacher
# 5. with a teacher and data: the quality table of the GPU recipe
set -uo pipefail
out=$1
mkdir -p "$out"
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; timeout "$limit" "$@"; echo "== exit $?"; }
step 60 python scripts/check_kernels_gpu.py --front --output "$out/kernels_gpu_front.json"
step 40 python scripts/check_kernels_gpu.py --rope --output "$out/kernels_gpu_rope.json"
step 40 python scripts/check_kernels_gpu.py --kl --output "$out/kernels_gpu_kl.json"
step 420 python scripts/check_kernels_gpu.py --cases 0,2,5,6,7,8,9,10,17,1,3,4,11,14,12,13,15,16 \
    --output "$out/kernels_gpu_errors.json"
step 540 python scripts/bench_kernels.py --output "$out/bench_kernels.json" --markdown "$out/bench_kernels.md"
step 240 python scripts/profile_kernels.py --output "$out/profile_kernels.json"
step 200 python scripts/profile_ncu.py --output "$out/ncu_forward_2x8192.json"
step 240 python scripts/bench_distill.py --variants --output "$out/bench_distill_variants.json"
if [ $# -ge 3 ]; then
    step 400 bash scripts/gpu_quality.sh "$2" "$3" "$out/quality"
fi
