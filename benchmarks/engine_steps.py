"""Steady decoding steps through the Engine: AR vs self-speculation at B rows × L context (the open item of
session 10: a spec step at 64 rows measured ~2.5× an AR step in `bench throughput`, where ~1.3–1.8× was
expected).

Fills B slots with L-token essay windows, steps until every request is decoding (no prefill left), then
times `--steps` whole `Engine.step()` calls (device synchronized around each) and, with --profile, prints
the top CUDA kernels of a few steps (torch.profiler) — for AR and for speculation, side by side, from one
loaded model. The last lines are a short table.

    PYTHONPATH=/tmp/site:src REDWOOD_HOME=$PWD/.stage/home python3 benchmarks/engine_steps.py \
        --model /root/t.gguf --rows 64 --context 8192 --profile
"""

from __future__ import annotations

import argparse
import time

import torch

from redwood.bench.speculative import DEFAULT_DATASET, PromptSource, make_prompts
from redwood.config import SpeculativeConfig
from redwood.engine.engine import Engine
from redwood.llm import LLM
from redwood.sampling_params import SamplingParams


def fill(engine, prompts, new_tokens: int) -> None:
    """Add every prompt and step until all of them have their first token (prefill done)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = set()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    while len(started) < len(prompts):
        for d in engine.step():
            if d.token_ids:
                started.add(d.request_id)


def timed_steps(engine, steps: int, device) -> tuple[list[float], list[int]]:
    times, tokens = [], []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        deltas = engine.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(d.token_ids) for d in deltas))
    return times, tokens


def profile_steps(engine, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (the eager step also splits draft / verify)")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    spec = SpeculativeConfig(self_speculate=True, draft_kv="streaming", draft_budget=args.budget,
                             num_draft_tokens=args.gamma)
    llm = LLM(args.model, dtype="bfloat16", device="cuda", speculative=spec, max_num_seqs=1)
    target, tok, drafter, tree = llm.model, llm.tokenizer, llm.drafter, llm.tree
    llm.engine = None
    del llm
    source = PromptSource(dataset=DEFAULT_DATASET)
    prompts = make_prompts(tok, source, args.rows, args.context, 0)
    new = (args.steps + 8) * (args.gamma + 1) * 2 + 16
    rows = []
    for mode in ("ar", "spec"):
        kw = dict(drafter=drafter, tree=tree) if mode == "spec" else {}
        engine = Engine.build(target, tok, max_num_seqs=args.rows, max_model_len=args.context + new + 8,
                              max_num_batched_tokens=args.context, cuda_graphs=not args.eager, **kw)
        fill(engine, prompts, new)
        timed_steps(engine, 3, target.device)  # warm-up: graph captures of this bucket
        times, tokens = timed_steps(engine, args.steps, target.device)
        if args.profile:
            print(f"\n=== {mode}: torch.profiler over 3 steps ===")
            print(profile_steps(engine, 3, args.top))
        ms = sorted(times)[len(times) // 2] * 1e3
        tps = sum(tokens) / sum(times)
        rows.append((mode, ms, sum(tokens) / len(tokens) / args.rows, tps))
        for i in range(args.rows):
            engine.abort(f"r{i}", notify=False)
        del engine
        torch.cuda.empty_cache()
    print(f"\nEngine steps, bf16, {args.rows} rows × {args.context} context, self-spec streaming {args.budget}, "
          f"γ={args.gamma}, graphs={not args.eager}")
    print("| mode | step ms (median) | tokens/row/step | tok/s |")
    print("|---|---|---|---|")
    for mode, ms, tpr, tps in rows:
        print(f"| {mode} | {ms:.2f} | {tpr:.2f} | {tps:.0f} |")
    print(f"spec/AR step time {rows[1][1] / rows[0][1]:.2f}×, throughput {rows[1][3] / rows[0][3]:.2f}×")


if __name__ == "__main__":
    main()
