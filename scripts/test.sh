#!/usr/bin/env bash
# Set up with the test extras (pytest, triton, openai; chromium for the playground's browser test), then run
# the whole test suite (unit tests on tiny random models + tests on real registry models).
# Extra arguments go to pytest, e.g. `./scripts/test.sh -m "not real"` for the fast unit tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"
