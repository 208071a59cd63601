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

# Debian's chromium for the playground's headless-browser test (tests/serve/test_playground.py). Installed only
# when missing and we can (root with apt); otherwise that test says how to get it (or skips with
# REDWOOD_SKIP_BROWSER=1). `apt-get update` runs only when an install is needed, so a set-up machine stays fast.
if ! command -v chromium >/dev/null 2>&1 && [ "${REDWOOD_SKIP_BROWSER:-0}" != 1 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing chromium (apt) for the playground browser test" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends chromium; } >/dev/null; then
            echo "setup: could not install chromium; the playground browser test will fail until it is" \
                 "installed (or set REDWOOD_SKIP_BROWSER=1)" >&2
        fi
    else
        echo "setup: chromium not found and not root with apt: install Debian's chromium" \
             "(sudo apt-get install chromium) for the playground browser test, or set REDWOOD_SKIP_BROWSER=1" >&2
    fi
fi
