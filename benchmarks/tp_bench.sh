#!/usr/bin/env bash
# Tensor parallelism on several GPUs of one host (issue 41: nvidia-h200-x2; NCCL), TP=1 next to TP=N in the same call.
#
# On the GPU machine, from the repo root, with the 1.5B target staged as for h200_bench.sh (/root/stage/t??, see
# h200_env.sh):
#     OUT=/path benchmarks/tp_bench.sh STEP...        steps: equal p1 steps summary
# - equal: greedy `redwood generate` of the real 1.5B in float32 at TP=1 and TP=N (NCCL, CUDA graphs with the
#   all-reduces captured) — the token ids must match (a mismatch prints the first differing position);
# - p1: `redwood bench ar` batch-1 decode of the 1.5B (bf16) at TP=1 and TP=N;
# - steps: `benchmarks/tp_step.py` step times of random-weight models (1.5B and an 8B, Llama-3.1-8B's shape) at
#   TP=1 and TP=N: decode (1 token) and verify (5 tokens) forwards at batch 1 and STEP_BATCH (default 32) rows of
#   STEP_CONTEXT (default 4096) keys, and the all-reduces / logits gather by themselves;
# - summary: the short table last (TP=1 vs TP=N per measurement, and docs/perf/tensor-parallel.md's projection).
# Settings: TP (default 2: the GPUs), STEP_SHAPES (default "1.5b 8b"), STEP_BATCH, STEP_CONTEXT, GEN (p1's tokens,
# default 256). NVLink multicast stays off (the device notes: NCCL_NVLS_ENABLE=0 …), set here again.
set -euo pipefail
OUT=${OUT:-/tmp/out}
. "$(dirname "$0")/h200_env.sh"  # wheels, PYTHONPATH, REDWOOD_HOME, the staged GGUFs → T, D; R, run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${TP:-2}
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node $N"

for step in "$@"; do case $step in
equal)
  for n in 1 $N; do
    run $R generate --model "$T" --device cuda --dtype float32 --prompt "def quicksort(xs):" --max-new-tokens 64 \
        --tensor-parallel-size $n --json > "$OUT/equal-tp$n.json"
  done
  python3 - "$OUT/equal-tp1.json" "$OUT/equal-tp$N.json" <<'EOF' | tee "$OUT/equal.txt"
import json, sys
a, b = (json.load(open(p))["token_ids"] for p in sys.argv[1:])
diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
print("greedy TP=N == TP=1" if diff is None and len(a) == len(b) else f"greedy tokens differ first at {diff}")
EOF
  ;;
p1)
  for n in 1 $N; do
    run $R bench ar --model "$T" --dtype bfloat16 --device cuda --prompt-len 128 --gen-len ${GEN:-256} --repeats 3 \
        --tensor-parallel-size $n --json > "$OUT/p1-tp$n.json"
  done ;;
steps)
  for shape in ${STEP_SHAPES:-1.5b 8b}; do
    for batch in 1 ${STEP_BATCH:-32}; do
      args="--device cuda --shape $shape --tokens 1 5 --batch $batch --context ${STEP_CONTEXT:-4096} --repeats 20"
      run python3 benchmarks/tp_step.py $args --json "$OUT/step-$shape-b$batch-tp1.json" | tail -5
      run $TORCHRUN benchmarks/tp_step.py $args --json "$OUT/step-$shape-b$batch-tp$N.json" | tail -5
    done
  done ;;
summary)
  run python3 benchmarks/tp_summary.py "$OUT" ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac; done
