#!/usr/bin/env bash
# Issue 6's benchmarks on the H200 (P1–P5), with the real Qwen2.5-Coder 1.5B target / 0.5B draft (bf16).
#
# On the GPU machine, from the repo root, after staging the GGUF chunks as /root/stage/t?? (1.5B) and
# /root/stage/d?? (0.5B), carrying .whl (the gguf wheel) and .stage/home (REDWOOD_HOME with the essays,
# humaneval and mt-bench datasets):
#     OUT=/path benchmarks/h200_bench.sh STEP...      steps: tests (tests-a, tests-b; tests-ab: both at once) kernels pdl l2 tile mega p1 steps p2 p3 p3tree p4 draftattn width level e2e split auto p5 summary pack
# Each step writes JSON under $OUT and prints its tables; `summary` prints the short P1–P5 table last.
# Settings (environment): P2_TEMPS, P2_GAMMAS, P2_DRAFT_WEIGHTS (bf16 int8), P2_ACC (a folder of acceptance vectors measured earlier with
# the same models, [p2-]acc-<dataset>-t<temp>.json: reused instead of measured), P2_ACC_PROMPTS, P3_KV, P3_BATCH, P3_CONTEXT, P3_GAMMAS,
# P3_GEN, P3_BUDGET (the draft cache's budget, default 512), E2E_CONTEXT / E2E_REQUESTS / E2E_GEN / E2E_GAMMA / E2E_DRAFTER (the e2e step), P3_ACC_PROMPTS (p3tree: essays for the self-draft's acceptance vector, default 8), P3_PROFILE (1: also `redwood profile` each cell's verify and compressed draft forwards at the largest
# batch), P5_ACC (default: p2's HumanEval greedy vector), P5_BUDGETS, P5_DEPTH, P5_GEN, P5_PREFETCH (layers in the
# offload ring, default 16), P5_TREE (extra
# trees), GEMV_ARGS, GPU_TESTS, GPU_FLAGS, L2_MB, MEGA_VARIANTS. Programmatic dependent launch, the L2 prefetch and the
# megakernel's experiment #defines are arguments of the benchmark scripts (decode_step.py --pdl / --l2-prefetch,
# megakernel_bench.py --variants), not environment variables. Each invocation must fit
# the machine's 10-minute call limit: e.g. `tests p1 steps` + greedy p2, then T = 0.6 p2 + p5, then p3 alone.
set -euo pipefail
OUT=${OUT:-/tmp/out}
. "$(dirname "$0")/h200_env.sh"  # wheels, PYTHONPATH, REDWOOD_HOME, the staged GGUFs → T, D; R, run
GPU=${GPU_FLAGS:---dtype bfloat16 --device cuda}

for step in "$@"; do case $step in
tests|tests-a|tests-b)  # the GPU tests: kernels vs float64, graphed steps == eager, speculation exact on CUDA.
  # The whole suite takes longer than one call (10 min): tests-a (the megakernel, the other kernels but test_gemv,
  # the engine's CUDA tests; ~5 min) and tests-b (attention + test_gemv; ~8 min) in two calls
  case $step in
    tests-a) sel="tests/kernels --ignore=tests/kernels/test_gemv.py tests/engine/test_runner.py tests/sample/test_random.py tests/engine/test_logprobs.py tests/models/test_offload.py" ;;
    tests-b) sel="tests/attention tests/kernels/test_gemv.py" ;;
    *) sel=${GPU_TESTS:-tests/attention tests/kernels tests/engine/test_runner.py tests/sample/test_random.py tests/engine/test_logprobs.py tests/models/test_offload.py} ;;
  esac
  run python3 -m pytest -q -p no:cacheprovider $sel 2>&1 | tee "$OUT/$step.txt" | tail -15 \
    || echo "GPU TESTS FAILED (the steps after this one still run)" ;;
tests-ab)  # tests-a and tests-b side by side in one call (their time is mostly Triton compiling, one core each; the
          # children find the wheels installed: no second install races the first)
  bash "$0" tests-a > "$OUT/tests-a.log" 2>&1 & pa=$!
  bash "$0" tests-b > "$OUT/tests-b.log" 2>&1 || true
  wait $pa || true
  tail -n 3 "$OUT/tests-a.txt" "$OUT/tests-b.txt" ;;  # (-n: the obsolete "-3" form takes one file only)
kernels)  # the skinny kernels vs cuBLAS (a sweep that merges into this GPU's tile table, copied to $OUT),
          # then decode steps of random 1.5B / 0.5B models with the skinny path off / on at 1-8 tokens
  run python3 benchmarks/gemv_bench.py ${GEMV_ARGS:---sweep --int8 --rows 1} --write src/redwood/kernels/gemv_configs \
      2>&1 | tee "$OUT/gemv-bench.txt" | tail -50
  cp src/redwood/kernels/gemv_configs/*.json "$OUT/"
  run python3 benchmarks/decode_step.py --quick --tokens 1 2 5 8 --skinny-rows 8 2>&1 | tee "$OUT/decode-1.5b.txt" | tail -12
  run python3 benchmarks/decode_step.py --quick --shape 0.5b --tokens 1 2 5 --skinny-rows 8 2>&1 \
      | tee "$OUT/decode-0.5b.txt" | tail -10 ;;
pdl)  # programmatic dependent launch (decode_step.py --pdl) vs plain launches, side by side in one process: decode
     # steps of random 1.5B / 0.5B models, one token (AR, a draft level) and 2-8 (verifies; tree draft levels),
     # the skinny variants taking up to 8 tokens (the tile kernel) next to cuBLAS
  run python3 benchmarks/decode_step.py --quick --pdl --skinny-rows 8 --tokens 1 7 2>&1 | tee "$OUT/pdl-1.5b.txt" | tail -14
  run python3 benchmarks/decode_step.py --quick --pdl --skinny-rows 8 --shape 0.5b --tokens 1 2 4 8 2>&1 \
      | tee "$OUT/pdl-0.5b.txt" | tail -26
  # the 2-8-row kernels per matrix (heuristic config: the CUDA-core rows kernel) vs cuBLAS, no sweep
  run python3 benchmarks/gemv_bench.py --rows 2 4 8 2>&1 | tee "$OUT/gemv-rows.txt" | tail -34 ;;
l2)  # weights prefetched into L2 ahead of their kernel (decode_step.py --l2-prefetch MB, redwood.kernels.l2_prefetch) vs
     # none, side by side in one process, each also with PDL: one-token forwards of random 1.5B (bf16) and 0.5B
     # (int8: a draft level) models at context 512 — the budget sweep L2_MB
  run python3 benchmarks/decode_step.py --quick --pdl --context 512 --l2-prefetch ${L2_MB:-8 16 24 32 40} 2>&1 \
      | tee "$OUT/l2-1.5b.txt" | tail -22
  run python3 benchmarks/decode_step.py --quick --pdl --context 512 --shape 0.5b --int8 --l2-prefetch ${L2_MB:-8 16 24 32 40} \
      2>&1 | tee "$OUT/l2-0.5b.txt" | tail -22 ;;
mega)  # the one-token megakernel (redwood.kernels.megakernel) vs the skinny path, side by side in one process: random
      # 1.5B / 0.5B-shaped models at 512 / 4096 keys, paged caches, bf16 then int8 weights (its W8 build vs the
      # skinny int8 kernels), its build with the defaults and each MEGA_VARIANTS string of
      # megakernel_bench.py --variants (#defines, e.g. MEGA_VARIANTS='"" "NSLOT=4" "ATTN_CPB=16"'; default: the defaults, then the
      # pending experiments ATTN_EARLY_ROW and MERGE_PRELOAD, alone and together);
      # then the profiling build's stage timeline (with the slot waits and the slowest block) at 1.5B / 512 keys
  if [ -n "${MEGA_VARIANTS:-}" ]; then eval "variants=($MEGA_VARIANTS)"; else variants=("" ATTN_EARLY_ROW MERGE_PRELOAD "ATTN_EARLY_ROW MERGE_PRELOAD"); fi
  run python3 benchmarks/megakernel_bench.py --shapes 1.5b 0.5b --contexts 512 4096 --caches paged --weights bf16 int8 \
      --variants "${variants[@]}" 2>&1 | tee "$OUT/mega-bench.txt" | tail -$((8 * ${#variants[@]} + 2))
  run python3 benchmarks/megakernel_bench.py --shapes 1.5b --contexts 512 --caches paged --timeline 2>&1 \
      | tee "$OUT/mega-timeline.txt" | head -10 ;;
tile)  # batched one-token forwards (P3's batch-64 draft levels, AR at batch 64) through the skinny path's
       # tile kernel vs cuBLAS + the small fused kernels: the 1.5B matrices at TILE_SWEEP_ROWS (64) rows (a
       # sweep merged into this GPU's table with tile_rows TILE_ROWS, 33-64), the tile kernel's GPU tests,
       # then graphed decode steps of a random 1.5B model at TILE_BATCHES (64) over 512 keys, both paths; the
       # table (copied to $OUT) keeps tile_rows only if the tile kernel's step was faster. Run it in the same
       # call before p3 to measure P3 with it (each call starts from the committed table)
  run python3 benchmarks/gemv_bench.py --sweep --rows ${TILE_SWEEP_ROWS:-64} --only 1.5b \
      --write src/redwood/kernels/gemv_configs --tile-rows ${TILE_ROWS:-33 64} 2>&1 | tee "$OUT/gemv-tile.txt" \
      | tail -20 || echo "TILE SWEEP FAILED"
  run python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py -k "tile or batched or linear" 2>&1 \
      | tail -4 || echo "GEMV TESTS FAILED"
  for b in ${TILE_BATCHES:-64}; do
    run python3 benchmarks/decode_step.py --quick --batch $b --context 512 --tokens 1 2>&1 \
        | tee "$OUT/tile-b$b.txt" | tail -5 || echo "DECODE STEP FAILED"
  done
  # the table keeps tile_rows only if the first of TILE_BATCHES measured faster through the tile kernel
  b=$(echo ${TILE_BATCHES:-64} | cut -d' ' -f1)
  run python3 benchmarks/tile_rows_decide.py "$OUT/tile-b$b.txt" src/redwood/kernels/gemv_configs/NVIDIA_H200.json \
      || git checkout src/redwood/kernels/gemv_configs  # no comparison: the committed table
  cp src/redwood/kernels/gemv_configs/*.json "$OUT/" ;;
p1)  # batch-1 autoregressive decode vs the memory floor vs HF transformers, same weights, same run
  run $R bench ar --model "$T" $GPU --prompt-len 128 --gen-len 256 --repeats 3 --compare-hf --output "$OUT/p1" ;;
steps)  # what one speculative step costs next to the forwards it runs (random 1.5B/0.5B-shaped models)
  run python3 benchmarks/spec_step.py --kernels --gen-len 64 2>&1 | tee "$OUT/spec-step.txt" | tail -40 ;;
p2)  # batch-1 speculation with the 0.5B draft: chains and the hardware-aware DP tree, code and chat;
     # once per draft weight format (P2_DRAFT_WEIGHTS: bf16, int8 = --draft-weights int8; acceptance vectors
     # are measured once, with the bf16 draft)
  mkdir -p "$OUT/p2"
  for temp in ${P2_TEMPS:-0 0.6}; do
    for ds in humaneval mt-bench; do
      acc="$OUT/p2/acc-$ds-t$temp.json"
      prior=$(ls ${P2_ACC:-/nonexistent}/acc-$ds-t$temp.json ${P2_ACC:-/nonexistent}/p2-acc-$ds-t$temp.json 2>/dev/null | head -1 || true)
      if [ -n "$prior" ]; then
        cp "$prior" "$acc"  # a vector measured earlier with the same models and dtype
      elif [ ! -f "$acc" ]; then
        # code: teacher-forced on HumanEval's reference solutions; chat: MT-Bench has no references, so
        # the vector comes from real generation (depth-1 trees of width 8)
        mode=static; [ $ds = mt-bench ] && mode=dynamic
        run $R acceptance --model "$T" --draft-model "$D" $GPU --width 8 --mode $mode --temperature $temp \
            --dataset $ds --num-prompts ${P2_ACC_PROMPTS:-16} --gen-len 128 --output "$acc" --quiet
      fi
    done
    for wq in ${P2_DRAFT_WEIGHTS:-bf16 int8}; do
      sfx=""; quant=""
      if [ $wq = int8 ]; then sfx="-int8"; quant="--draft-weights int8"; fi
      run $R profile --model "$T" --draft-model "$D" $GPU $quant --temperature $temp \
          --output "$OUT/p2/profile-t$temp$sfx.json"
      for ds in humaneval mt-bench; do
        run $R tree-search --acceptance "$OUT/p2/acc-$ds-t$temp.json" --budget 64 --max-depth 10 \
            --profile "$OUT/p2/profile-t$temp$sfx.json" --output "$OUT/p2/tree-$ds-t$temp$sfx.json" --json \
            > "$OUT/p2/tree-$ds-t$temp$sfx.summary.json"
        run $R bench standalone --model "$T" --draft-model "$D" $GPU $quant --batch-size 1 --prefix-len 128 \
            --gen-len 128 --gamma ${P2_GAMMAS:-2 3 4 6} --tree "$OUT/p2/tree-$ds-t$temp$sfx.json" --dataset $ds \
            --temperature $temp --seed 1 --output "$OUT/p2/bench-$ds-t$temp$sfx"
      done
    done
  done ;;
p3)  # MagicDec self-speculation at long context (StreamingLLM and SnapKV draft caches of 512 tokens), best γ per cell;
     # one invocation (and report) per policy and context, so a long grid keeps what it finished
  for ctx in ${P3_CONTEXT:-32704 16384 8192}; do  # 32704 + 64 generated = the models' 32K window
    for kv in ${P3_KV:-streaming snapkv}; do
      budget=${P3_BUDGET:-512}  # the issue's cap; for streaming it accepts more than 256 (session 7: 1.95x vs 1.84x)
      run $R bench selfspec --model "$T" $GPU --batch-size ${P3_BATCH:-1 16 32 64} --prefix-len $ctx \
          --gen-len ${P3_GEN:-64} --gamma ${P3_GAMMAS:-2 3 4} --draft-kv $kv --draft-budget $budget \
          --output "$OUT/p3-$kv-$ctx"
      if [ -n "${P3_PROFILE:-}" ]; then  # where a step goes: verify of 1-5 tokens, a compressed draft level
        b=$(echo ${P3_BATCH:-1 16 32 64} | awk '{print $NF}')
        run $R profile --model "$T" $GPU --batch-size $b --context $ctx --tokens 1,2,3,4,5 --widths 1 \
            --no-overhead --draft-kv $kv --draft-budget $budget --repeats 3 --warmup 1 \
            --output "$OUT/p3-$kv-$ctx/profile-b$b.json"
      fi
    done
  done ;;
p3tree)  # Sequoia trees for MagicDec self-speculation at one P3 serving point: the acceptance vector of the target
         # drafting over its compressed cache (dynamic, held-out essay windows), the profile at batch × context,
         # tree-search, then the bench with that tree next to chains
  ctx=${P3_CONTEXT:-32704}; b=${P3_BATCH:-64}; kv=${P3_KV:-streaming}
  budget=${P3_BUDGET:-512}
  d="$OUT/p3tree-$kv-$ctx-b$b"; mkdir -p "$d"
  run $R acceptance --model "$T" $GPU --self-speculate --draft-kv $kv --draft-budget $budget --width 4 \
      --mode dynamic --temperature 0 --dataset essays --num-prompts ${P3_ACC_PROMPTS:-8} --prompt-len $((ctx - 8)) \
      --gen-len ${P3_GEN:-64} --output "$d/acc.json" --quiet
  run $R profile --model "$T" $GPU --batch-size $b --context $ctx --tokens 1,2,4,8,16 --widths 1,2,4 \
      --no-overhead --draft-kv $kv --draft-budget $budget --repeats 3 --warmup 1 --output "$d/profile.json"
  run $R tree-search --acceptance "$d/acc.json" --profile "$d/profile.json" --budget 16 --max-depth 6 \
      --output "$d/tree.json" --json > "$d/tree.summary.json"
  run $R bench selfspec --model "$T" $GPU --batch-size $b --prefix-len $ctx --gen-len ${P3_GEN:-64} --gamma 2 3 \
      --tree "$d/tree.json" --draft-kv $kv --draft-budget $budget --output "$d/bench" ;;
p4)  # the attention kernel against the KV-read floor and SDPA (chains and trees at batch 64 × 32K, trees at
     # batch 1-8), after its variants' registers / shared memory / programs per SM on this machine's Triton
  run python3 benchmarks/kernel_resources.py 2>&1 | tee "$OUT/kernel-resources.txt" | tail -22 || echo "(kernel_resources failed)"
  run python3 benchmarks/attention_bench.py --output "$OUT/p4.json" ;;
draftattn)  # issue 40 item 3: the self-draft level's attention as the engine runs it (a 512-token StreamingLLM view of
           # 30K-token paged rows, keys gathered one by one) against its byte floor, num_splits 1-16 and block sizes swept
  # (the gathered view, then the same view as two slot ranges: `span`, what the engine passes since session 33)
  run python3 benchmarks/attention_bench.py --only view --sweep --output "$OUT/draftattn.json" 2>&1 \
      | tee "$OUT/draftattn.txt" | tail -40
  run python3 benchmarks/attention_bench.py --only span --sweep --output "$OUT/draftattn-span.json" 2>&1 \
      | tee "$OUT/draftattn-span.txt" | tail -40 ;;
width)  # the verify width of prompt lookup's long chains (auto-policy.md item 24): 64 rows × 32K, T = 8, 9, 11, 17
        # new tokens a row — past T = 10 a KV head's query rows take two 64-row tiles; the sweep tries 128-row ones
  run python3 benchmarks/attention_bench.py --only "chain B=64 T=8" --output "$OUT/width-t8.json" 2>&1 | tail -3
  run python3 benchmarks/attention_bench.py --only width --sweep --output "$OUT/width.json" 2>&1 \
      | tee "$OUT/width.txt" | tail -40 ;;
level)  # issue 40 item 3 without staging: the draft level of a random 1.5B at LEVEL_BATCH (64) × LEVEL_CONTEXT (30720)
        # over a StreamingLLM 4 + 508 view, as two slot ranges (span) and gathered, next to the AR step, against floors
  run python3 benchmarks/draft_level.py --batch ${LEVEL_BATCH:-64} --context ${LEVEL_CONTEXT:-30720} --kernels \
      --output "$OUT/level.json" 2>&1 | tee "$OUT/level.txt" | tail -40 ;;
e2e)  # issue 40 item 3, MagicDec's regime end to end: E2E_REQUESTS (64) requests at once over E2E_CONTEXT-token essay
     # windows (30720 + 2048 = the 32K window), E2E_GEN (2048) new tokens each, AR vs self-speculation over a
     # StreamingLLM view of P3_BUDGET (512) with γ E2E_GAMMA (3) — or E2E_DRAFTER="--draft-model $D" — in one call;
     # E2E_SPECULATIVE=auto: the automatic policy plans every step over that drafter (and prompt lookup) instead;
     # E2E_ENGINE: engine flags for both sides (e.g. "--prefill-first --max-num-batched-tokens 8192")
  ctx=${E2E_CONTEXT:-30720}; n=${E2E_REQUESTS:-64}; gen=${E2E_GEN:-2048}
  drafter=${E2E_DRAFTER:---self-speculate --draft-kv streaming --draft-budget ${P3_BUDGET:-512}}
  plan="--gamma ${E2E_GAMMA:-3}"; [ "${E2E_SPECULATIVE:-fixed}" = auto ] && plan="--speculative auto"
  run $R bench throughput --model "$T" $GPU --num-requests $n --prompt-len $ctx --min-new-tokens $gen \
      --max-new-tokens $gen --max-num-seqs $n $drafter $plan --dataset essays ${E2E_ENGINE:-} \
      --output "$OUT/e2e-$(echo "$plan $drafter" | tr -cs 'a-z0-9' '-' | cut -c1-64)" ;;  # (the plan first: the cut kept only the drafter)
split)  # issue 40 item 3: the MagicDec step's split against its floors at E2E_REQUESTS × E2E_CONTEXT — whole Engine steps
        # (AR and self-speculation γ E2E_GAMMA over StreamingLLM P3_BUDGET, their top kernels, and the rows' prefill),
        # the graphed verify and draft level (`redwood profile`), then benchmarks/step_floors.py's table (floors from
        # this GPU's measured copy bandwidth; the end-to-end bound from the e2e reports already under $OUT)
  ctx=${E2E_CONTEXT:-30720}; n=${E2E_REQUESTS:-64}; g=${E2E_GAMMA:-3}; budget=${P3_BUDGET:-512}
  run python3 benchmarks/engine_steps.py --model "$T" --rows $n --context $ctx --gamma $g --budget $budget --profile \
      --json "$OUT/split-steps.json" 2>&1 | tee "$OUT/split-steps.txt" | tail -7
  run $R profile --model "$T" $GPU --batch-size $n --context $ctx --tokens 1,$((g + 1)) --widths 1 --no-overhead \
      --draft-kv streaming --draft-budget $budget --repeats 3 --warmup 1 --output "$OUT/split-profile.json"
  run python3 benchmarks/step_floors.py --model "$T" --steps "$OUT/split-steps.json" --profile "$OUT/split-profile.json" \
      --e2e $(ls -d "$OUT"/e2e-* 2>/dev/null) 2>&1 | tee "$OUT/split.txt" ;;
auto)  # issue 40 item 2: the automatic policy next to AR and the fixed plan (γ 3), one `bench throughput` per cell
       # (--compare-fixed 3: AR, fixed, auto interleaved in one process on the same prompts, one AR run for both):
       # batch-1 code / chat with the 0.5B draft at AUTO_TEMPS (0 0.6), then self-speculation (StreamingLLM 512) at
       # AUTO_CONTEXT × AUTO_BATCH windows of AUTO_DATASET (essays; shakespeare: held out), AUTO_GEN new tokens;
       # AUTO_PART: b1, long or both; AUTO_REPEATS: the plans interleaved this many times (medians reported);
       # AUTO_REQUESTS: batch-1 requests per plan (16). The grid's "32K" is AUTO_CONTEXT=32512 (prompt + 256 new
       # tokens must fit the 1.5B's 32,768). The table last: benchmarks/auto_cells.py
  for part in ${AUTO_PART:-b1 long}; do
    if [ $part = b1 ]; then
      for temp in ${AUTO_TEMPS:-0 0.6}; do for ds in humaneval mt-bench; do
        run $R bench throughput --model "$T" --draft-model "$D" $GPU --num-requests ${AUTO_REQUESTS:-16} --max-num-seqs 1 \
            --prompt-len 128 --min-new-tokens 128 --max-new-tokens 128 --dataset $ds --temperature $temp --seed 1 \
            --speculative auto --compare-fixed 3 --repeats ${AUTO_REPEATS:-1} \
            --quiet --output "$OUT/auto/b1-$ds-t$temp--auto-vs-fixed3" | tail -8 || echo "CELL FAILED"
      done; done
    else
      for ctx in ${AUTO_CONTEXT:-8192 16384}; do for b in ${AUTO_BATCH:-16 64}; do
        run $R bench throughput --model "$T" $GPU --self-speculate --draft-kv streaming --draft-budget 512 --num-requests $b \
            --max-num-seqs $b --prompt-len $ctx --min-new-tokens ${AUTO_GEN:-256} --max-new-tokens ${AUTO_GEN:-256} \
            --dataset ${AUTO_DATASET:-essays} --speculative auto --compare-fixed 3 --repeats ${AUTO_REPEATS:-1} --quiet \
            --output "$OUT/auto/${AUTO_DATASET:-essays}-ctx$ctx-b$b--auto-vs-fixed3" | tail -8 || echo "CELL FAILED"
      done; done
    fi
  done
  run python3 benchmarks/auto_cells.py "$OUT/auto" ;;
p5)  # offloaded target (weights streamed from pinned host memory): AR vs large trees picked for that cost
     # profile: the offloaded target's forward is ~flat in tokens (host-link bound), so deep trees pay
  mkdir -p "$OUT/p5"
  acc=${P5_ACC:-$OUT/p2/acc-humaneval-t0.json}
  pf="--offload-prefetch ${P5_PREFETCH:-16}"  # ring depth: copies of the next verify's layers run during drafting
  run $R profile --model "$T" --draft-model "$D" $GPU --offload $pf --temperature 0 --tokens 1,16,64,128,256 \
      --output "$OUT/p5/profile-offload.json"
  trees=""
  for budget in ${P5_BUDGETS:-64 128}; do
    run $R tree-search --acceptance "$acc" --budget $budget --max-depth ${P5_DEPTH:-16} \
        --profile "$OUT/p5/profile-offload.json" --output "$OUT/p5/tree-$budget.json" --json \
        > "$OUT/p5/tree-$budget.summary.json"
    trees="$trees $OUT/p5/tree-$budget.json"
  done
  run $R bench standalone --model "$T" --draft-model "$D" $GPU --offload $pf --batch-size 1 --prefix-len 128 \
      --gen-len ${P5_GEN:-64} --gamma 4 --tree $trees ${P5_TREE:-} --dataset humaneval --output "$OUT/p5/bench" ;;
summary)
  run python3 benchmarks/h200_summary.py "$OUT" ;;
pack)  # last: the device tool brings back at most 8 files from $OUT (2 folders deep) — a p2 run writes dozens —
       # so everything goes into one archive, $OUT/out.tgz (`tar xzf out.tgz` here)
  tar czf /tmp/h200-out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/h200-out.tgz "$OUT/out.tgz"
  ls -l "$OUT" ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac; done
