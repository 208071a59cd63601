#!/usr/bin/env bash
# Real-model GPU runs (eager engine, no CUDA graphs yet): run on the GPU machine after staging the two
# Qwen GGUFs as /root/stage/t?? (1.5B) and /root/stage/d?? (0.5B) chunks and carrying .whl (gguf wheel)
# and .stage/home (REDWOOD_HOME with the essays dataset). Prints short tables; JSON reports go to $OUT.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 REDWOOD_HOME=$PWD/.stage/home
cat /root/stage/t?? > /root/t.gguf; cat /root/stage/d?? > /root/d.gguf
sha256sum /root/t.gguf /root/d.gguf
OUT=${OUT:-/tmp/out}
R="python3 -m redwood.cli"
$R bench ar --model /root/t.gguf --dtype bfloat16 --device cuda --prompt-len 128 --gen-len 128 --compare-hf \
    --output $OUT/ar 2>&1 | tail -6
$R bench standalone --model /root/t.gguf --draft-model /root/d.gguf --dtype bfloat16 --device cuda \
    --batch-size 1 --prefix-len 256 --gen-len 128 --gamma 3 5 --output $OUT/standalone 2>&1 | tail -8
$R bench selfspec --model /root/t.gguf --dtype bfloat16 --device cuda --batch-size 8 --prefix-len 4096 \
    --gen-len 64 --gamma 2 3 --draft-kv streaming --draft-budget 256 --output $OUT/selfspec 2>&1 | tail -8
