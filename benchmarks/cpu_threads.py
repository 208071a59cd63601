"""Decode tokens/s against torch's CPU thread count, as a user runs it: `redwood generate --threads N`.

For each thread count (1, 2, ... up to the usable cores, and torch's own default), one run of plain
decoding of the target and one with the draft model, each a fresh `redwood generate --json` process
(the model loads every time, as a user's command would; OMP_NUM_THREADS is removed from the
environment so only --threads decides). Runs alternate between the counts so that a load on the
machine from elsewhere lands on each of them alike. Prints one line per run, then a table.

    .venv/bin/python benchmarks/cpu_threads.py       # 1.5B target, 0.5B draft, float32, 32 new tokens
    .venv/bin/python benchmarks/cpu_threads.py --max-new-tokens 64 --threads 1 2 --weights int8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REDWOOD = Path(sys.executable).with_name("redwood")
# 48 tokens through Qwen2.5's chat template (scripts/run.sh's prompt, lengthened to the issue's 48)
PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and hints."


def torch_default_threads() -> int:
    """What torch picks by itself (no OMP_NUM_THREADS), in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def run_once(args, threads: int, draft: str | None) -> dict:
    cmd = [
        str(REDWOOD),
        "generate",
        "--model",
        args.model,
        "--chat",
        "--prompt",
        args.prompt,
        "--json",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--ignore-eos",
        "--threads",
        str(threads),
        "--weights",
        args.weights,
    ]
    if draft:
        cmd += ["--draft-model", draft]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"cpu_threads: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    stats = json.loads(proc.stdout.splitlines()[-1])["stats"]
    spec = stats.get("speculative") or {}
    return {
        "threads": threads,
        "draft": draft,
        "wall_s": wall,
        "prompt_tokens": stats["prompt_tokens"],
        "generated": stats["generated_tokens"],
        "prefill_s": stats["prefill_s"],
        "decode_tok_s": stats["decode_tokens_per_s"],
        "acceptance": spec.get("acceptance_rate"),
        "tokens_per_step": spec.get("mean_accepted_length"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--weights", default="float32", help="--weights for redwood generate (default float32)")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="thread counts (default: 1 .. usable cores, and torch's default)",
    )
    p.add_argument("--output", type=Path, default=None, help="also write the runs as JSON here")
    args = p.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    default = torch_default_threads()
    counts = args.threads or sorted(set(range(1, cores + 1)) | {default})
    print(
        f"cpu_threads: {cores} usable cores, torch's default {default} threads; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    runs = []
    for draft in (None, args.draft_model):
        for threads in counts:
            r = run_once(args, threads, draft)
            runs.append(r)
            print(
                f"  threads {threads} {'draft ' + draft if draft else 'AR':>34}: {r['decode_tok_s']:.2f} tok/s "
                f"decode, prefill {r['prefill_s']:.2f} s ({r['prompt_tokens']} tokens), wall {r['wall_s']:.0f} s",
                flush=True,
            )
    if args.output:
        args.output.write_text(json.dumps({"cores": cores, "torch_default": default, "runs": runs}, indent=2))

    print(
        f"\n{args.model}, {args.weights} weights, {runs[0]['prompt_tokens']}-token chat prompt, "
        f"{args.max_new_tokens} new tokens (decode tokens/s; wall = whole command with the load)"
    )
    header = ["threads", "AR tok/s", "AR wall s", "draft tok/s", "draft wall s", "tokens/step", "spec / AR"]
    rows = []
    for threads in counts:
        ar = next(r for r in runs if r["threads"] == threads and r["draft"] is None)
        sp = next(r for r in runs if r["threads"] == threads and r["draft"] is not None)
        label = f"{threads}" + (" (torch default)" if threads == default else "")
        rows.append(
            [
                label,
                f"{ar['decode_tok_s']:.2f}",
                f"{ar['wall_s']:.0f}",
                f"{sp['decode_tok_s']:.2f}",
                f"{sp['wall_s']:.0f}",
                f"{sp['tokens_per_step'] or 0:.2f}",
                f"{sp['decode_tok_s'] / ar['decode_tok_s']:.2f}x" if ar["decode_tok_s"] else "-",
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for r in [header] + rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
