#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install megabase with its test and benchmark extras.
# Without an NVIDIA GPU it installs the CPU build of torch first, so pip does not fetch a
# multi-GB CUDA build; set TORCH_SPEC to choose another torch (e.g. TORCH_SPEC='torch==2.14.1').
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"megabase needs Python >= 3.11, found {sys.version.split()[0]} (set PYTHON=...)")
PY
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC='torch>=2.4,<2.15'
  else
    TORCH_SPEC='torch==2.13.0'
  fi
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "megabase is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
