#!/usr/bin/env bash
# Create .venv (if missing) and install redwood into it. Idempotent.
#   scripts/setup.sh          what the main job needs (scripts/run.sh): redwood and g++ for the CPU kquant kernel
#   scripts/setup.sh --test   also the test extras (pytest, triton, openai, …) and chromium for the playground's
#                             headless-browser test (scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
test_deps=0
for arg in "$@"; do
    case $arg in
        --test) test_deps=1 ;;
        *) echo "setup: unknown argument $arg (only --test)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned: on CPU machines the local CPU build of 2.13.0 is taken (a bare `torch` would pull
# a multi-GB CUDA build). Skip when a torch is already installed.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==${REDWOOD_TORCH_VERSION:-2.13.0}"
fi
if [ "$test_deps" = 1 ]; then
    .venv/bin/python -m pip install -q -e ".[test]"
else
    .venv/bin/python -m pip install -q -e .
fi

# Debian packages, installed only when missing and we can (root with apt; `apt-get update` runs once, only when an
# install is needed, so a set-up machine stays fast): g++ for the CPU kquant kernel (redwood.cpu_kernels; without
# a compiler the CPU default falls back to w8a8), and with --test chromium for the playground's headless-browser
# test (tests/serve/test_playground.py; without it that test says how to get it, or skips with
# REDWOOD_SKIP_BROWSER=1).
need=()
if [ "$test_deps" = 1 ] && ! command -v chromium >/dev/null 2>&1 && [ "${REDWOOD_SKIP_BROWSER:-0}" != 1 ]; then
    need+=(chromium)
fi
if ! command -v g++ >/dev/null 2>&1; then need+=(g++); fi
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing ${need[*]} (apt)" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends "${need[@]}"; } >/dev/null; then
            echo "setup: could not install ${need[*]}: without g++ the CPU runs w8a8 instead of kquant; the" \
                 "playground browser test fails until chromium is installed (or set REDWOOD_SKIP_BROWSER=1)" >&2
        fi
    else
        echo "setup: ${need[*]} not found and not root with apt: install them (sudo apt-get install" \
             "${need[*]}) — g++ for the CPU kquant kernel, chromium for the playground browser test (or set" \
             "REDWOOD_SKIP_BROWSER=1)" >&2
    fi
fi

# Build the CPU kquant kernel now (~30 s once, cached by torch under ~/.cache/torch_extensions) rather than in
# the first generation — the build for this CPU's instruction set (AVX-512 VNNI, AVX2 or portable C++); a machine
# that cannot run it is told why and keeps the other CPU formats.
.venv/bin/python -c "
from redwood.cpu_kernels import kquant
why = kquant.why_unavailable()
if why:
    print(f'setup: the CPU kquant kernel is not available ({why}); CPU weights default to w8a8 / gguf')
else:
    print(f'setup: the CPU kquant kernel: the {kquant.variant()} build')
"
