#!/usr/bin/env bash
# Issue 18's serving measurements (and issue 17's stream) on the H200: `redwood bench serve` against a real
# `redwood serve`, speculation vs autoregressive decoding with the same server flags otherwise, the
# Qwen2.5-Coder 1.5B target (bf16) and its 0.5B draft.
#
# On the GPU machine, from the repo root, after staging the GGUFs as /root/stage/t?? (1.5B) and
# /root/stage/d?? (0.5B), carrying .whl (gguf + fastapi, starlette, pydantic, pydantic-core, uvicorn,
# annotated-types, typing-inspection: the server's packages the machine lacks) and .stage/home (REDWOOD_HOME
# with the essays and mt-bench datasets):
#     OUT=/path benchmarks/h200_serve.sh STEP...     steps: stream long long-distinct chat ramp compare
# Every step writes report folders under $OUT and prints its tables; `compare` prints the ratios last.
# Settings (environment): LONG_LEN (prompt tokens, default 24576), LONG_SHARED (of them common to all
# requests, default LONG_LEN - 1024), LONG_N (requests, default 128), LONG_CONC (in flight, default 64),
# LONG_MIN / LONG_MAX (output tokens drawn from, default 256 / 512), SPEC_FLAGS (the self-speculation,
# default streaming 512 γ 3), GPU_FLAGS (default --dtype bfloat16 --device cuda), CHAT_N (MT-Bench questions, default 16), CHAT_FLAGS (the draft-model flags),
# RAMP_SIDES (ar fixed auto) / RAMP_LEN / RAMP_LEVELS / RAMP_TOKENS / RAMP_AUTO (the ramp step: prompt tokens, default 16384; concurrency levels,
# default 1 4 16 32 64; output tokens, default 256; the automatic policy's drafter flags, default streaming 512;
# RAMP_ROUNDS: requests per level in units of its concurrency (default 2: a level at 1 is two requests — noisy);
# RAMP_PROFILE=1: py-spy records the server's stacks during each level, ramp-*/pyspy.txt — carry its wheel in .whl);
# SERVER_FLAGS: more server flags for both sides of the long steps (e.g. --prefill-first).
set -euo pipefail
OUT=${OUT:-/tmp/out}
. "$(dirname "$0")/h200_env.sh"  # wheels, PYTHONPATH, REDWOOD_HOME, the staged GGUFs → T, D; R, run
PORT=${PORT:-8031}
URL=http://127.0.0.1:$PORT
LONG_LEN=${LONG_LEN:-24576}
LONG_SHARED=${LONG_SHARED:-$((LONG_LEN - 1024))}
LONG_N=${LONG_N:-128}
LONG_CONC=${LONG_CONC:-64}
LONG_MIN=${LONG_MIN:-256}
LONG_MAX=${LONG_MAX:-512}
SPEC_FLAGS=${SPEC_FLAGS:---self-speculate --draft-kv streaming --draft-budget 512 --gamma 3}
CHAT_N=${CHAT_N:-16}
CHAT_FLAGS=${CHAT_FLAGS:---draft-model $D --gamma 4}

SERVER=
serve() {  # serve LOG FLAGS...: start `redwood serve` in the background, wait for /health (≤ 5 minutes)
  local log=$1; shift
  echo >&2; echo "\$ redwood serve $* &" >&2
  $R serve --model "$T" ${GPU_FLAGS:---dtype bfloat16 --device cuda} --port "$PORT" --log-level warning "$@" >"$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do
    if python3 -c "import httpx,sys; sys.exit(httpx.get('$URL/health', timeout=2).status_code != 200)" 2>/dev/null
    then return 0; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "SERVER DIED:" >&2; tail -20 "$log" >&2; return 1; fi
    sleep 1
  done
  echo "SERVER NEVER HEALTHY" >&2; tail -20 "$log" >&2; return 1
}
metrics() {  # metrics FILE: the server's speculation counters now (plan steps, accepted tokens): cumulative —
  # each level's file holds the totals since the server started (the level before's subtracted by hand); and beside
  # it policy.json, the policy's own report (GET /speculation: under auto, expected vs achieved tokens, realized
  # ratios, measured / predicted step times per family and bucket)
  python3 -c "import httpx; print(httpx.get('$URL/metrics', timeout=10).text)" 2>/dev/null \
    | grep -E '^redwood:(spec_decode|num_preemptions|prompt_tokens|generation_tokens)' >"$1" || true
  python3 -c "import httpx; print(httpx.get('$URL/speculation', timeout=30).text)" >"$(dirname "$1")/policy.json" \
    2>/dev/null || true
}
stop() {  # SIGTERM drains (running requests finish), then the process exits
  if [ -n "$SERVER" ]; then kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; SERVER=; fi
}
trap stop EXIT

load_long() {  # load_long NAME SHARED: an untimed warm-up stream (other prompts: another seed), then the stream
  local name=$1 shared=$2
  # the warm-up: the same shape with other text (no prefix-cache hit for the timed prompts), short outputs;
  # it takes every batch bucket as requests join one prefill chunk at a time, and a full-length prefill
  run $R bench serve --base-url "$URL" --tokenizer "$T" --prompt-len $LONG_LEN --shared-prefix-len $shared \
      --num-requests $LONG_CONC --max-concurrency $LONG_CONC --max-tokens 24 --ignore-eos --prompt-seed 99 \
      --json >/dev/null
  run $R bench serve --base-url "$URL" --tokenizer "$T" --label "$name" --prompt-len $LONG_LEN \
      --shared-prefix-len $shared --num-requests $LONG_N --max-concurrency $LONG_CONC --min-tokens $LONG_MIN \
      --max-tokens $LONG_MAX --ignore-eos --output "$OUT/$name" | tail -16
  metrics "$OUT/$name/metrics.txt"  # (and policy.json beside it: under auto, the plans it ran)
}
# the server flags common to both sides of a long-context comparison
LONG_SERVER="--max-num-seqs $LONG_CONC --max-model-len $((LONG_LEN + LONG_MAX + 64)) --max-num-batched-tokens 8192 ${SERVER_FLAGS:-}"

for step in "$@"; do case $step in
stream)  # issue 17: the shared-document stream through the Engine directly (AR then spec, one process)
  run $R bench throughput --model "$T" ${GPU_FLAGS:---dtype bfloat16 --device cuda} --self-speculate --draft-kv streaming \
      --draft-budget 512 --gamma 3 --num-requests 64 --prompt-len 31744 --shared-prefix-len 30720 \
      --enable-prefix-caching --min-new-tokens 192 --max-new-tokens 384 --max-num-seqs 64 \
      --max-num-batched-tokens 8192 --request-rate inf --output "$OUT/stream" 2>&1 | tail -30 ;;
long)  # (a) LONG_CONC concurrent streams of LONG_LEN-token essay prompts sharing LONG_SHARED tokens (one
       # document, many questions: the server's prefix cache holds it), self-speculation vs AR
  serve "$OUT/server-long-ar.log" $LONG_SERVER --enable-prefix-caching
  load_long long-ar $LONG_SHARED; stop
  serve "$OUT/server-long-spec.log" $LONG_SERVER --enable-prefix-caching $SPEC_FLAGS
  load_long long-spec $LONG_SHARED; stop
  run $R bench serve --compare "$OUT/long-ar" "$OUT/long-spec" --output "$OUT/long-compare" ;;
long-distinct)  # (a') the same with every prompt its own window: each request prefills LONG_LEN tokens
  serve "$OUT/server-distinct-ar.log" $LONG_SERVER
  load_long distinct-ar 0; stop
  serve "$OUT/server-distinct-spec.log" $LONG_SERVER $SPEC_FLAGS
  load_long distinct-spec 0; stop
  run $R bench serve --compare "$OUT/distinct-ar" "$OUT/distinct-spec" --output "$OUT/distinct-compare" ;;
chat)  # (b) batch-1 chat: MT-Bench first turns one at a time, the 0.5B draft vs AR, greedy then T = 0.6
  for side in ar spec; do
    flags=""; [ $side = spec ] && flags=$CHAT_FLAGS
    serve "$OUT/server-chat-$side.log" --max-num-seqs 4 --max-model-len 4096 $flags
    run $R bench serve --base-url "$URL" --endpoint chat --dataset mt-bench --num-requests 4 --max-tokens 32 \
        --max-concurrency 1 --json >/dev/null  # warm-up: the bucket-1 graphs
    for temp in 0 0.6; do
      run $R bench serve --base-url "$URL" --endpoint chat --dataset mt-bench --label chat-$side-t$temp \
          --num-requests $CHAT_N --max-tokens 256 --max-concurrency 1 --temperature $temp --seed 1 \
          --output "$OUT/chat-$side-t$temp" | tail -14
    done
    stop
  done
  for temp in 0 0.6; do
    run $R bench serve --compare "$OUT/chat-ar-t$temp" "$OUT/chat-spec-t$temp" --output "$OUT/chat-compare-t$temp"
  done ;;
ramp)  # issue 40 item 2: a load ramping from 1 to 64 concurrent long-context requests (distinct essay windows of
       # RAMP_LEN tokens, RAMP_TOKENS new each, RAMP_ROUNDS × C requests at concurrency C) against three servers — AR, the
       # fixed plan (SPEC_FLAGS) and `--speculative auto` — with the same flags otherwise; the table last
  levels=${RAMP_LEVELS:-1 4 16 32 64}; top=$(echo $levels | awk '{print $NF}')
  rlen=${RAMP_LEN:-16384}; rtok=${RAMP_TOKENS:-256}
  ramp_server="--max-num-seqs $top --max-model-len $((rlen + rtok + 64)) --max-num-batched-tokens 8192"
  auto_flags=${RAMP_AUTO:---self-speculate --draft-kv streaming --draft-budget 512 --speculative auto}
  for side in ${RAMP_SIDES:-ar fixed auto}; do
    flags=""; [ $side = fixed ] && flags=$SPEC_FLAGS; [ $side = auto ] && flags=$auto_flags
    serve "$OUT/server-ramp-$side.log" $ramp_server $flags
    # warm-up (other text, short outputs): every batch bucket up to the top level, and auto's calibration
    run $R bench serve --base-url "$URL" --tokenizer "$T" --prompt-len $rlen --num-requests $top \
        --max-concurrency $top --max-tokens 24 --ignore-eos --prompt-seed 99 --json >/dev/null
    for c in $levels; do
      spy=
      if [ -n "${RAMP_PROFILE:-}" ]; then  # the server's Python stacks during the level (py-spy, collapsed)
        mkdir -p "$OUT/ramp-$side-c$c"
        py-spy record --pid $SERVER --rate 100 --nonblocking --format raw \
            --output "$OUT/ramp-$side-c$c/pyspy.txt" >"$OUT/ramp-$side-c$c/pyspy.log" 2>&1 & spy=$!
      fi
      run $R bench serve --base-url "$URL" --tokenizer "$T" --label "ramp-$side-c$c" --prompt-len $rlen \
          --num-requests $((${RAMP_ROUNDS:-2} * c)) --max-concurrency $c --max-tokens $rtok --ignore-eos \
          --output "$OUT/ramp-$side-c$c" | tail -4
      if [ -n "$spy" ]; then kill -INT $spy; wait $spy || true; fi
      metrics "$OUT/ramp-$side-c$c/metrics.txt"
    done
    stop
  done
  run python3 benchmarks/ramp_table.py "$OUT" $levels ;;
compare)  # every comparison measured so far, ratios to AR
  for pair in long distinct; do
    [ -d "$OUT/$pair-ar" ] && [ -d "$OUT/$pair-spec" ] && $R bench serve --compare "$OUT/$pair-ar" "$OUT/$pair-spec"
  done
  for temp in 0 0.6; do
    [ -d "$OUT/chat-ar-t$temp" ] && [ -d "$OUT/chat-spec-t$temp" ] \
      && $R bench serve --compare "$OUT/chat-ar-t$temp" "$OUT/chat-spec-t$temp"
  done; true ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac; done
