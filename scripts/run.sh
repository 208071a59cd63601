#!/usr/bin/env bash
# The main job: set up, then generate with the embedded default model pair — the Qwen2.5-Coder-1.5B
# target speculating with the Qwen2.5-Coder-0.5B draft (both pulled from the registry on first use).
# The output is exactly the target's greedy output; the stats line shows the acceptance.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/redwood generate --chat --draft-model qwen2.5-coder-0.5b-instruct --gamma 3 \
    --prompt "${1:-Write a Python function that checks whether a number is prime.}" "${@:2}"
