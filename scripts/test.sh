#!/usr/bin/env bash
# Set up, then run the whole test suite (unit tests on tiny random models + tests on real registry models).
# Extra arguments go to pytest, e.g. `./scripts/test.sh -m "not real"` for the fast unit tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
