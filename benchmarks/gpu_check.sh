#!/usr/bin/env bash
# The GPU check, in one script for a lent GPU machine (see README, "On a GPU"):
#   1. here, once: bash benchmarks/fetch_gpu_wheels.sh      (wheels of what the GPU image lacks)
#   2. device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It installs megabase (no dependencies fetched: the image has torch, triton, lightning...), runs
# the CUDA tests and the Triton-vs-reference kernel tests, then benchmarks/bench_gpu.py, and leaves
# gpu_check.md and gpu_check.log in $OUT. About 8 minutes at most.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
exec > >(tee "$OUT/gpu_check.log") 2>&1
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

# kernels vs reference on CUDA, KDA via fla vs our chunk form, streaming vs full in bf16
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/kernels/test_dsa_triton.py
tests=$?

left=$(( 470 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
  timeout "$left" "$PY" benchmarks/bench_gpu.py --out "$OUT/gpu_check.md" --budget $(( left - 30 ))
fi
echo "gpu_check: tests exit $tests, $(( $(date +%s) - start )) s in all"
exit $tests
