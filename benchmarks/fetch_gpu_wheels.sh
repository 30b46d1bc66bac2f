#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.sh needs and the GPU image (Python 3.12, torch, triton,
# lightning, numpy, safetensors...) lacks, downloaded here into .whl/ (git-ignored) to be carried.
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl isal fla-core
ls -la .whl
