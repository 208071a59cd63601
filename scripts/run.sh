#!/usr/bin/env bash
# The main job: set up (redwood, and g++ for the CPU kquant kernel; not the test extras or the browser), then
# generate with the embedded default model pair — the Qwen2.5-Coder-1.5B target speculating with the
# Qwen2.5-Coder-0.5B draft (both pulled from the registry on first use).
# The output is the target's greedy output; the stats line shows the acceptance and the wall time of prefill
# and decode, and the line after it (--compare-ar) the target decoding the same prompt autoregressively for
# 64 tokens in the same run: AR vs speculation tokens/s and the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/redwood generate --chat --draft-model qwen2.5-coder-0.5b-instruct --gamma 3 --compare-ar \
    --prompt "${1:-Write a Python function that checks whether a number is prime.}" "${@:2}"
