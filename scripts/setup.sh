#!/usr/bin/env bash
# Create .venv (if missing) and install redwood with its test extras into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned: on CPU machines the local CPU build of 2.13.0 is taken (a bare `torch` would pull
# a multi-GB CUDA build). Skip when a torch is already installed.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==${REDWOOD_TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
