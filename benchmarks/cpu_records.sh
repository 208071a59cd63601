#!/usr/bin/env bash
# The CPU records of issues 2, 3 and 4: real Qwen2.5-Coder 1.5B target / 0.5B draft, float32, batch 1,
# on the 2-core development machine, one run after another on an otherwise idle machine.
# Usage: benchmarks/cpu_records.sh OUT_DIR [STEP…]   steps: ar standalone selfspec trees (default: all)
# Each run writes OUT_DIR/<run>/report.json; tables go to stdout.
set -euo pipefail
OUT=${1:-out/cpu-records}
shift || true
STEPS=${*:-ar standalone selfspec trees}
mkdir -p "$OUT"
R=${REDWOOD:-redwood}
T=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
run() { echo; echo "\$ $*"; "$@"; }

for step in $STEPS; do case $step in
ar)  # issue 2: autoregressive decode vs Hugging Face transformers generate, same weights and prompts
  run $R bench ar --model $T --batch-size 1 --prompt-len 128 --gen-len 32 --compare-hf --output "$OUT/ar" ;;
standalone)  # issue 3: the 0.5B draft at short prompts, greedy and T=0.6
  for temp in 0 0.6; do
    run $R bench standalone --model $T --draft-model $D --batch-size 1 --prefix-len 128 --gen-len 32 \
        --gamma 3 --temperature $temp --seed 1 --output "$OUT/standalone-t$temp"
  done ;;
selfspec)  # issue 3: self-speculation, StreamingLLM and SnapKV drafts (budget 256): greedy at a 4K-token
           # prompt; T=0.6 at 1K (a 4K prefill takes ~4 minutes on this CPU, and each run prefills twice)
  for kv in streaming snapkv; do
    run $R bench selfspec --model $T --batch-size 1 --prefix-len 4096 --gen-len 16 --gamma 3 \
        --draft-kv $kv --draft-budget 256 --output "$OUT/selfspec-$kv-t0"
    run $R bench selfspec --model $T --batch-size 1 --prefix-len 1024 --gen-len 16 --gamma 3 \
        --draft-kv $kv --draft-budget 256 --temperature 0.6 --seed 1 --output "$OUT/selfspec-$kv-t0.6"
  done ;;
trees)  # issue 4: AR vs chain vs DP tree on HumanEval; tokens per step measured vs predicted by tree
       # search. The vector is measured on held-out HumanEval prompts (the back of the document order);
       # the bench draws its prompts from the front, so both see the same distribution.
  for temp in 0 0.6; do
    run $R acceptance --model $T --draft-model $D --width 8 --mode static --temperature $temp \
        --dataset humaneval --num-prompts 4 --gen-len 64 --output "$OUT/acceptance-t$temp.json" --quiet
    run $R tree-search --acceptance "$OUT/acceptance-t$temp.json" --budget 16 --max-depth 6 \
        --output "$OUT/tree16-t$temp.json"
    run $R bench standalone --model $T --draft-model $D --batch-size 1 --prefix-len 128 --gen-len 24 \
        --gamma 4 --tree "$OUT/tree16-t$temp.json" --dataset humaneval --temperature $temp --seed 1 \
        --output "$OUT/tree-t$temp"
  done ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac; done
