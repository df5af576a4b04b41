set -u
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .carry/w/*.whl >/dev/null 2>&1
cp .carry/p1/smol.aa /root/ &
timeout 240 python scripts/check_kernels_gpu.py --cases 5,6,7,8,12,3,4 --output $OUT/kernels_gpu_errors_main.json 2>&1 | grep -v Warn | tail -9
timeout 90 python scripts/bench_distill.py --iters 9 --output $OUT/bench_distill_rows.json 2>&1 | grep -E "capture_s|gdn_blocks|vs_teacher|host_s|tokens_per_s"
timeout 90 python scripts/bench_distill.py --iters 9 --doc-len 512 --output $OUT/bench_distill_packed512.json 2>&1 | grep -E "capture_s|gdn_blocks|vs_teacher|host_s|tokens_per_s"
wait; ls -la /root/smol.aa
