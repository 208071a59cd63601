#!/usr/bin/env bash
# Static checks (CI runs them before the tests; set up first with scripts/setup.sh --test):
#   the import contract (pyproject's [tool.importlinter]: the layers run one way), ruff's lint, ruff's format.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
