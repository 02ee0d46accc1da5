#!/usr/bin/env bash
# Set up a virtual environment in .venv with spotlight installed (editable, with test extras).
# Where no NVIDIA GPU is visible, install the CPU build of torch first, so that the package's
# `torch` requirement is already met and pip does not pull a multi-GB CUDA build.
# Override the torch requirement with SPOTLIGHT_TORCH (e.g. SPOTLIGHT_TORCH="torch==2.13.0").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    $PIP install --quiet "${SPOTLIGHT_TORCH:-torch==2.13.0}"
fi
$PIP install --quiet -e ".[dev]"
echo "spotlight installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
