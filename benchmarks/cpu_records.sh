#!/usr/bin/env bash
# The CPU records: real Qwen2.5-Coder 1.5B target / 0.5B draft, batch 1, on the 2-core development machine.
#   ar standalone selfspec trees   issues 2, 3 and 4 (float32; one run after another on an idle machine)
#   llamacpp-build                 issue 20 item 4: build llama.cpp's CPU tools from the source that the
#                                  llama-cpp-python sdist on PyPI vendors (skipped when the binaries exist)
#   peer                           issue 20 item 4: llama.cpp and redwood side by side on the same GGUF files
#                                  and the same 128-token code prompt, greedy, 128 new tokens, 1 and 2 threads;
#                                  and prompt processing (512 random tokens: llama-bench pp512, redwood's prefill)
# Usage: benchmarks/cpu_records.sh OUT_DIR [STEP…]   (default steps: ar standalone selfspec trees)
# Each redwood run writes OUT_DIR/<run>/report.json; tables go to stdout. `peer` writes OUT_DIR/peer/ (every
# command's stdout/stderr, runs.tsv, peer.json, summary.md) and builds llama.cpp first when needed; it takes
# ~28 minutes on the 2-core machine (3 repeats × 2 thread counts; the build adds 10-22 minutes once).
# Environment: REDWOOD (the CLI; default the repo's .venv/bin/redwood, else `redwood` on PATH), PYTHON (a python
# with redwood installed, for the prompt and the table), REDWOOD_HOME (models, default ~/.cache/redwood),
# LLAMACPP_DIR (llama.cpp source and build, default $REDWOOD_HOME/bench/llama.cpp — outside the repo: the build
# is ~200 MB), LLAMACPP_PY_VERSION (the llama-cpp-python sdist that vendors it), PEER_REPEATS (default 3),
# PEER_THREADS (default "1 2"), PEER_PARTS (default "decode pp"), LLAMACPP_LEVEL (native or avx2, below; each level its own llama.cpp build).
set -euo pipefail
OUT=${1:-out/cpu-records}
shift || true
STEPS=${*:-ar standalone selfspec trees}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${REDWOOD:-} && -x $REPO/.venv/bin/redwood ]]; then REDWOOD=$REPO/.venv/bin/redwood; fi
R=${REDWOOD:-redwood}
if [[ -z ${PYTHON:-} && -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; fi
PY=${PYTHON:-python3}
T=qwen2.5-coder-1.5b-instruct
D=qwen2.5-coder-0.5b-instruct
RW_HOME=${REDWOOD_HOME:-$HOME/.cache/redwood}
LLAMACPP_DIR=${LLAMACPP_DIR:-$RW_HOME/bench/llama.cpp}
# pinned so that a re-run measures the same llama.cpp; 0.3.36 vendors llama.cpp 0.5.0-dev (2026-12)
LLAMACPP_PY_VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
# LLAMACPP_LEVEL: native (-march=native: AVX-512 VNNI on the development machine) or avx2 (GGML_NATIVE=OFF: SSE4.2,
# AVX, AVX2, BMI2, FMA, F16C and no AVX-512 — llama.cpp's "haswell" level, the CPU class of issue 38). At avx2 the
# redwood runs are capped the same way (REDWOOD_CPU_ISA=avx2: the avx2 kquant build; ATEN_CPU_CAPABILITY=avx2).
LLAMACPP_LEVEL=${LLAMACPP_LEVEL:-native}
case $LLAMACPP_LEVEL in
  native) BUILD=$LLAMACPP_DIR/build LEVEL_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD=$LLAMACPP_DIR/build-avx2 LEVEL_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
          -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF)
        export REDWOOD_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ;;
  *) echo "LLAMACPP_LEVEL must be native or avx2, not $LLAMACPP_LEVEL" >&2; exit 2 ;;
esac
LB=$BUILD/bin
# llama-bench: decode tok/s of the Q4/Q5/Q6 file alone; llama-completion: the same prompt end to end;
# llama-speculative-simple: draft-model speculation (one target, one draft, a chain — redwood's setting)
LLAMACPP_TOOLS=(llama-bench llama-completion llama-speculative-simple)
run() { echo; echo "\$ $*"; "$@"; }

# The configure line. GGML_NATIVE: -march=native (AVX-512, VNNI, BF16 on this CPU); Release, CPU only, no
# network code (LLAMA_CURL is deprecated and ignored in this version; LLAMA_OPENSSL is its successor), no server.
# AMX off (-mno-amx-*; GCC drops AMX from -march=native in either order): on the 2-core development VM the
# CPU advertises AMX and a plain ldtilecfg + tilezero works, but ggml's AMX matmul dies of SIGILL on its first
# tilezero (llama-completion's warm-up decode, 1 thread, Q4_K weights), so a native build cannot run there.
LLAMACPP_CMAKE=(-DCMAKE_BUILD_TYPE=Release "${LEVEL_FLAGS[@]}" -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF
  "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF)

llamacpp_build() {
  local stamp=$BUILD/redwood-build.txt want missing=0 t
  want="llama-cpp-python $LLAMACPP_PY_VERSION; ${LLAMACPP_CMAKE[*]}; ${LLAMACPP_TOOLS[*]}"
  for t in "${LLAMACPP_TOOLS[@]}"; do [[ -x $LB/$t ]] || missing=1; done
  # skipped only when every tool exists and was built from this sdist with these flags
  if (( ! missing )) && [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "llama.cpp tools already built in $LB ($want)"; return
  fi
  mkdir -p "$LLAMACPP_DIR/sdist"
  local sdist=$LLAMACPP_DIR/sdist/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz
  if [[ ! -f $sdist ]]; then
    # --no-binary: the wheel has no CLI tools; the sdist carries llama.cpp's whole tree in vendor/llama.cpp
    run "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMACPP_PY_VERSION" \
        -d "$LLAMACPP_DIR/sdist"
  fi
  # a fresh extraction touches every source file (a full rebuild): only when the sdist changed
  if [[ $(cat "$LLAMACPP_DIR/src/.sdist" 2>/dev/null) != "$LLAMACPP_PY_VERSION" ]]; then
    rm -rf "$LLAMACPP_DIR/src"
    mkdir -p "$LLAMACPP_DIR/src"
    tar xzf "$sdist" -C "$LLAMACPP_DIR/src" --strip-components=1
    echo "$LLAMACPP_PY_VERSION" >"$LLAMACPP_DIR/src/.sdist"
  fi
  local gen=()
  if command -v ninja >/dev/null; then gen=(-G Ninja); fi
  run cmake -S "$LLAMACPP_DIR/src/vendor/llama.cpp" -B "$BUILD" "${gen[@]}" "${LLAMACPP_CMAKE[@]}"
  # 2 jobs: the development machine has 2 cores (10 minutes there quiet, 22 while other sessions' tests ran)
  run cmake --build "$BUILD" -j "${BUILD_JOBS:-2}" --target "${LLAMACPP_TOOLS[@]}"
  echo "$want" >"$stamp"
}

# ---------------------------------------------------------------------------------------------- peer
TF=$RW_HOME/models/$T/$T.gguf
DF=$RW_HOME/models/$D/$D.gguf
PEER_REPEATS=${PEER_REPEATS:-3}
PEER_THREADS=${PEER_THREADS:-1 2}
PEER_PARTS=${PEER_PARTS:-decode pp}  # decode: AR and speculation (llama.cpp's three tools, redwood's bench); pp
PEER_NEW=128

# Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal: /proc/stat's cpu line).
busy_s() { awk -v hz="$(getconf CLK_TCK)" '/^cpu / {printf "%.2f", ($2 + $3 + $4 + $7 + $8 + $9) / hz}' /proc/stat; }

# One timed command: stdout and stderr kept apart under $P; a line in $P/runs.tsv with its start, the load
# average before it, its wall seconds, exit status, its own CPU seconds and "others": the cores that everything
# else on the machine kept busy meanwhile ((machine busy seconds − its own) / wall; steal included). The machine
# is shared: the load average lags a minute, "others" says how much of the two cores a run really had.
timed() {
  local name=$1; shift
  local load start b0 b1 rc=0 real user sys
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$(date -Is)
  echo; echo "[$(date +%T)] load $load: $name"; echo "\$ $*"
  b0=$(busy_s)
  { TIMEFORMAT='%R %U %S'; time "$@" >"$P/$name.out" 2>"$P/$name.err"; } 2>"$P/$name.time" || rc=$?
  b1=$(busy_s)
  read -r real user sys <"$P/$name.time"
  rm -f "$P/$name.time"
  printf '%s\t%s\t%s\t%s\t%s\t%.1f\t%s\n' "$name" "$start" "$load" "$real" "$rc" "$(echo "$user + $sys" | bc)" \
      "$(echo "scale=2; ($b1 - $b0 - $user - $sys) / $real" | bc)" >>"$P/runs.tsv"
  echo "  ${real} s, others used $(tail -1 "$P/runs.tsv" | cut -f7) cores"
  # a failed run (another session's job can take the memory) is logged and left out of the table; the rest go on
  if (( rc )); then echo "  failed (exit $rc); tail of $P/$name.err:" >&2; tail -5 "$P/$name.err" >&2; return $rc; fi
}

peer() {
  llamacpp_build
  P=$OUT/peer
  mkdir -p "$P"
  [[ -f $TF && -f $DF ]] || { echo "pull the models first: $R models pull $T; $R models pull $D" >&2; exit 2; }
  # The prompt: benchmarks/cpu_spec.py's 128-token code prompt (HumanEval problems 100+, prompt + canonical
  # solution, joined by blank lines, cut at 128 Qwen tokens) as text, so that both engines tokenize the same
  # bytes; checked to re-tokenize to the same 128 ids (llama.cpp adds no BOS for this file: add_bos_token false).
  "$PY" - "$TF" "$P/prompt.txt" <<'PYEOF'
import json, sys
from redwood.data import recipes
from redwood.loading.gguf import load_gguf_tokenizer
tok = load_gguf_tokenizer(sys.argv[1])
docs = recipes.load_dataset("humaneval")
ids = tok.encode("\n\n".join(d["prompt"] + d["canonical_solution"] for d in docs[100:]))[:128]
text = tok.decode(ids)
if tok.encode(text) != ids:
    sys.exit("the prompt text does not re-tokenize to its 128 ids")
open(sys.argv[2], "w", encoding="utf-8").write(text)  # no trailing newline: llama.cpp's -f would strip one
json.dump(ids, open(sys.argv[2].replace(".txt", "_ids.json"), "w"))
print(f"prompt: {len(ids)} tokens, {len(text)} characters -> {sys.argv[2]}")
PYEOF
  {
    echo "date: $(date -Is)"; echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
    echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    local dirty=
    (cd "$REPO" && git diff --quiet HEAD -- src) || dirty=" (+ uncommitted src changes)"
    echo "checkout: $(cd "$REPO" && git rev-parse --short HEAD)$dirty; REDWOOD=$R PYTHONPATH=${PYTHONPATH:-}"
    echo "redwood imported from: $("$PY" -c 'import redwood; print(redwood.__file__)')"
    echo "torch: $("$PY" -c 'import torch; print(torch.__version__)')"
    echo "llama.cpp: llama-cpp-python $LLAMACPP_PY_VERSION sdist;" \
         "$("$LB/llama-completion" --version 2>&1 | tr '\n' ' ')"
    echo "target: $TF ($(stat -c %s "$TF") bytes)"; echo "draft: $DF ($(stat -c %s "$DF") bytes)"
  } | tee "$P/machine.txt"
  # the kquant build redwood's prompt processing runs: the one `auto` picks (under the level's cap)
  KQ=$("$PY" -c 'from redwood.cpu_kernels import kquant; print(kquant.variant())')
  echo "level: $LLAMACPP_LEVEL (llama.cpp $BUILD; redwood kquant build $KQ, REDWOOD_CPU_ISA=${REDWOOD_CPU_ISA:-native})" \
      | tee -a "$P/machine.txt"
  : >"$P/runs.tsv"
  local r t order fails=0
  # llama.cpp and redwood alternate inside every (repeat, threads) cell, and the thread order flips each
  # repeat, so a stretch of load from another session's jobs lands on both engines and both thread counts.
  for r in $(seq 1 "$PEER_REPEATS"); do
    order=$PEER_THREADS
    (( r % 2 )) || order=$(echo "$PEER_THREADS" | tr ' ' '\n' | tac | tr '\n' ' ')
    for t in $order; do
      if [[ " $PEER_PARTS " == *" decode "* ]]; then
      # (1) llama.cpp decode alone: tg128 from an empty context and after a 128-token context (-d 128: the
      # prompt length here); -r 2 samples per call, the repeats give the rest
      timed "r$r-t$t-llama-bench" "$LB/llama-bench" -m "$TF" -p 0 -n $PEER_NEW -d 0,128 -t "$t" -r 2 \
          -o json || fails=$((fails + 1))
      # (1b) llama.cpp AR on the prompt end to end (its eval time = the decode steps); -c 512 fits prompt +
      # 128 + a draft and keeps the KV allocation small; -no-cnv: the raw text, no chat template
      timed "r$r-t$t-llama-ar" "$LB/llama-completion" -m "$TF" -f "$P/prompt.txt" -n $PEER_NEW --temp 0 \
          --ignore-eos -t "$t" -c 512 -no-cnv --no-display-prompt || fails=$((fails + 1))
      # (2) llama.cpp draft-model speculation (--spec-type draft-simple: without it this version has no
      # speculator and fails to start), a chain of 3 draft tokens (n-min 0 and p-min 0: it never drafts
      # fewer), redwood's γ 3; target and draft both on $t threads
      timed "r$r-t$t-llama-spec" "$LB/llama-speculative-simple" -m "$TF" -md "$DF" -f "$P/prompt.txt" \
          -n $PEER_NEW --temp 0 --ignore-eos -t "$t" -td "$t" -c 512 --spec-type draft-simple \
          --spec-draft-n-max 3 --spec-draft-n-min 0 --spec-draft-p-min 0 || fails=$((fails + 1))
      # (3) redwood AR then speculation, 0.5B draft, chain γ 3, same process and prompt; --weights auto
      # (gguf for a GGUF target on the CPU since session 13, int4 for the draft); a warm-up runs first (not timed)
      timed "r$r-t$t-redwood" $R bench standalone --model "$TF" --draft-model "$DF" --prompts-file "$P/prompt.txt" \
          --prefix-len 128 --gen-len $PEER_NEW --gamma 3 --batch-size 1 --threads "$t" --weights auto \
          --output "$P/r$r-t$t-redwood" -q || fails=$((fails + 1))
      fi
      [[ " $PEER_PARTS " == *" pp "* ]] || continue
      # (4) prompt processing, 512 random tokens in one forward: llama-bench's pp512 (-r 2 samples a call) and
      # redwood's prefill through the C++ layers (the kquant build this level picks; the model loaded once, 2 rounds)
      timed "r$r-t$t-llama-pp" "$LB/llama-bench" -m "$TF" -p 512 -n 0 -t "$t" -r 2 -o json || fails=$((fails + 1))
      timed "r$r-t$t-redwood-pp" "$PY" "$REPO/benchmarks/cpu_variants.py" --model "$TF" --prompt 512 --decode 0 \
          --threads "$t" --rounds 2 --variants "$KQ" --json "$P/r$r-t$t-redwood-pp.json" || fails=$((fails + 1))
    done
  done
  "$PY" - "$P" <<'PYEOF' | tee "$P/summary.md"
# The table: per (engine, mode, threads) the median tok/s over every run, and over the quiet runs alone
# (others < QUIET cores: the rest of the machine left this run nearly both cores).
import json, re, statistics, sys
from pathlib import Path
QUIET = 0.3
P = Path(sys.argv[1])
runs = [l.split("\t") for l in (P / "runs.tsv").read_text().splitlines() if l]
if not runs:
    sys.exit("no runs to summarize")
rows = {}  # (engine, mode, threads) -> lists of tok/s, acceptance, output == AR's, others' cores
per_run = []  # every measurement with its run's name, start, load average before it, wall s and others
def add(key, tok_s, acc=None, same=None):
    d = rows.setdefault(key, {"tok_s": [], "acc": [], "same": [], "others": []})
    d["tok_s"].append(tok_s)
    d["others"].append(others)
    if acc is not None:
        d["acc"].append(acc)
    if same is not None:
        d["same"].append(same)
    per_run.append({"run": name, "start": when, "load": load, "wall_s": float(wall), "others_cores": others,
                    "engine": key[0], "mode": key[1], "threads": int(key[2]), "tok_s": tok_s,
                    "acceptance": acc, "same_as_ar": same})
def prompt_tokens(n, what):  # both engines must have read the same 128 tokens
    if int(n) != 128:
        sys.exit(f"{name}: {what} read {n} prompt tokens, not 128")
ar_text = {}  # (repeat, threads) -> llama.cpp AR's generated text
quant = None
for name, when, load, wall, rc, *rest in runs:
    others = float(rest[1]) if len(rest) > 1 else None  # (older runs.tsv files have no CPU columns)
    if rc != "0":
        continue
    r, t, tool = re.match(r"r(\d+)-t(\d+)-(.+)", name).groups()
    out, err = (P / f"{name}.out").read_text(), (P / f"{name}.err").read_text()
    if tool in ("llama-bench", "llama-pp"):
        for b in json.loads(out):
            quant = f"{b['model_type']}, {b['model_size'] / 2**30:.2f} GiB"
            mode = f"pp{b['n_prompt']}" if b["n_gen"] == 0 else f"AR llama-bench tg{b['n_gen']} @ d{b['n_depth']}"
            for s in b["samples_ts"]:
                add(("llama.cpp", mode, t), s)
    elif tool == "redwood-pp":
        for row in json.loads((P / f"{name}.json").read_text())["rows"]:
            for pre, _ in row["passes_s"]:
                add(("redwood", f"pp512 ({row['build']})", t), 512 / pre)
    elif tool == "llama-ar":
        prompt_tokens(re.search(r"prompt eval time =.*?/\s*(\d+) tokens", err).group(1), "llama-completion")
        m = re.search(r":\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", err)  # (not "prompt eval time")
        ar_text[r, t] = out
        add(("llama.cpp", "AR (prompt, 128 new)", t), int(m.group(2)) / (float(m.group(1)) / 1e3))
    elif tool == "llama-spec":
        prompt_tokens(re.search(r"encoded\s+(\d+) tokens", err).group(1), "llama-speculative-simple")
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
        acc = re.search(r"accept\s+=\s+([\d.]+)%", err)
        # its stdout: two newlines, the prompt, then the generated text (up to 3 tokens past 128: it stops after
        # a whole step); the same greedy text as AR's when AR's 128 tokens are its beginning
        prompt = "\n\n" + (P / "prompt.txt").read_text()
        gen = out.removeprefix(prompt).rstrip("\n") if out.startswith(prompt) else None
        ref = ar_text.get((r, t))
        same = None if ref is None or gen is None else gen.startswith(ref.rstrip("\n"))
        add(("llama.cpp", "spec 0.5B draft, 3 tokens", t), int(m.group(1)) / float(m.group(2)),
            float(acc.group(1)) / 100, same)
    elif tool == "redwood":
        run = json.loads((P / name / "report.json").read_text())["runs"][0]
        add(("redwood", "AR (prompt, 128 new)", t), run["ar_tokens_per_s"])
        add(("redwood", "spec 0.5B draft, γ 3", t), run["tokens_per_s"], run["acceptance_rate"],
            run.get("identical_to_ar"))
def median(xs):
    return statistics.median(xs) if xs else None
med = {k: median(v["tok_s"]) for k, v in rows.items()}
table = []
order = {"llama.cpp": 0, "redwood": 1}
for (eng, mode, t), v in sorted(rows.items(), key=lambda kv: (int(kv[0][2]), order[kv[0][0]], kv[0][1])):
    # prompt processing against llama.cpp's pp512, the rest against llama.cpp's AR on the prompt
    base = med.get(("llama.cpp", "pp512" if mode.startswith("pp") else "AR (prompt, 128 new)", t))
    rw_ar = med.get(("redwood", "AR (prompt, 128 new)", t))
    m = med[(eng, mode, t)]
    known = [o for o in v["others"] if o is not None]
    quiet = [x for x, o in zip(v["tok_s"], v["others"]) if o is not None and o < QUIET]
    table.append({"engine": eng, "mode": mode, "threads": int(t), "tok_s_median": m, "tok_s_all": v["tok_s"],
                  "others_cores_median": median(known), "tok_s_quiet_median": median(quiet), "quiet_runs": len(quiet),
                  "acceptance": median(v["acc"]), "same_as_ar": all(v["same"]) if v["same"] else None,
                  "x_llamacpp_ar": m / base if base else None,
                  "x_redwood_ar": m / rw_ar if eng == "redwood" and rw_ar else None})
(P / "peer.json").write_text(json.dumps({"llama_bench_model": quant, "quiet_below_cores": QUIET, "rows": table,
                                         "runs": per_run}, indent=2))
loads = [float(l[2].split()[0]) for l in runs]
oth = [float(l[6]) for l in runs if len(l) > 6]
print(f"\nllama.cpp reads the file as: {quant}; load average (1 min) before the runs: "
      f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})"
      + (f"; others' cores during the runs: {min(oth):.2f}-{max(oth):.2f} (median {statistics.median(oth):.2f})"
         if oth else ""))
f = lambda x, d=2: "" if x is None else f"{x:.{d}f}"
print("\n| engine | mode | threads | tok/s median | all runs | others' cores | quiet median (n) | acceptance "
      "| × llama.cpp AR (pp: its pp512) | × redwood AR | = AR |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for row in table:
    print(f"| {row['engine']} | {row['mode']} | {row['threads']} | {row['tok_s_median']:.2f} | "
          f"{' '.join(f'{x:.2f}' for x in row['tok_s_all'])} | {f(row['others_cores_median'])} | "
          f"{f(row['tok_s_quiet_median'])} ({row['quiet_runs']}) | {f(row['acceptance'])} | "
          f"{f(row['x_llamacpp_ar'])} | {f(row['x_redwood_ar'])} | "
          f"{'' if row['same_as_ar'] is None else 'yes' if row['same_as_ar'] else 'no'} |")
PYEOF
  if (( fails )); then echo "$fails runs failed (see $P/runs.tsv and their .err files)" >&2; return 1; fi
}

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
llamacpp-build)
  llamacpp_build ;;
peer)
  peer ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac; done
