"""Steady decoding steps through the Engine: AR vs speculation at B rows × L context (the open item of
session 10: a spec step at 64 rows measured ~2.5× an AR step in `bench throughput`, where ~1.3–1.8× was
expected).

Fills B slots with L-token essay windows, steps until every request is decoding (no prefill left), then
times `--steps` whole `Engine.step()` calls (device synchronized around each) and, with --profile, prints
the top CUDA kernels of a few steps (torch.profiler) — for AR and for speculation, side by side, from one
loaded model. --variants picks the speculation (self-speculation, or a standalone --draft-model reading its own
cache through a StreamingLLM view, optionally with int8 projections; MagicDec runs both); every variant is
timed against the one AR run. The last lines are a short table.

    PYTHONPATH=/tmp/site:src REDWOOD_HOME=$PWD/.stage/home python3 benchmarks/engine_steps.py \
        --model /root/t.gguf --rows 64 --context 8192 --profile
    ... --model /root/t.gguf --draft-model /root/d.gguf --variants self,draft,draft-int8 --context 24576
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from redwood.bench.speculative import DEFAULT_DATASET, PromptSource, make_prompts
from redwood.engine.engine import Engine
from redwood.engine.runner import sync
from redwood.llm import LLM
from redwood.sampling_params import SamplingParams
from redwood.speculation.config import SpeculativeConfig


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


def timed_steps(engine, steps: int, device) -> tuple[list[float], list[int], int]:
    """Wall time and tokens of `steps` steps, and the fewest rows any of them decoded."""
    times, tokens, fewest = [], [], None
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        deltas = engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(d.token_ids) for d in deltas))
        n = sum(1 for d in deltas if d.token_ids)
        fewest = n if fewest is None else min(fewest, n)
    return times, tokens, fewest or 0


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
    ap.add_argument("--draft-model", help="a standalone draft (e.g. the 0.5B GGUF) for the 'draft' variants")
    ap.add_argument(
        "--variants",
        default="self",
        help="comma-separated speculative variants, each timed against the one AR run: self "
        "(self-speculation, streaming --budget), draft (--draft-model, its own cache read "
        "through a streaming --budget view), draft-full (the draft reads its whole cache), "
        "draft-int8 (streaming, int8 draft projections)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (the eager step also splits draft / verify)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--device", default="cuda", help="(cpu: a smoke run of the script with a small model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", help="also write the table here (benchmarks/step_floors.py reads it)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        if v != "self" and not args.draft_model:
            ap.error(f"variant {v!r} needs --draft-model")
    specs = {}  # variant → (its target, drafter, tree): one load each (a self-drafter holds its target)
    for v in variants:
        llm = LLM(
            args.model, dtype=args.dtype, device=args.device, speculative=speculative_config(v, args), max_num_seqs=1
        )
        specs[v] = (llm.model, llm.drafter, llm.tree)
        tok = llm.tokenizer
        llm.engine = None
        del llm
    specs["ar"] = (specs[variants[0]][0], None, None)
    source = PromptSource(dataset=DEFAULT_DATASET)
    prompts = make_prompts(tok, source, args.rows, args.context, 0)
    chunk = min(args.context, 8192)  # (a longer chunk's activations outgrow an H100 beside 64 × 32K of KV)
    # every row keeps decoding through the fill (a step a prefill chunk: the first rows decode all along) and
    # the timed steps
    new = ((args.steps + 8) * 2 + args.rows * -(-args.context // chunk)) * (args.gamma + 1) + 16
    rows, fills = [], []
    for mode in ["ar", *variants]:
        target, drafter, tree = specs[mode]
        engine = Engine.build(
            target,
            tok,
            drafter=drafter,
            tree=tree,
            max_num_seqs=args.rows,
            max_model_len=args.context + new + 8,
            max_num_batched_tokens=chunk,
            cuda_graphs=not args.eager,
        )
        t_fill = time.perf_counter()
        fill(engine, prompts, new)
        fill_s = time.perf_counter() - t_fill  # (every row prefilled; the started rows decode alongside)
        timed_steps(engine, 3, target.device)  # warm-up: graph captures of this bucket
        times, tokens, fewest = timed_steps(engine, args.steps, target.device)
        if fewest < args.rows:  # (a row preempted or finished: these are not the rows-wide steps asked for)
            print(f"WARNING: {mode}: a timed step decoded only {fewest} of {args.rows} rows")
        if args.profile:
            print(f"\n=== {mode}: torch.profiler over 3 steps ===")
            print(profile_steps(engine, 3, args.top))
        ms = sorted(times)[len(times) // 2] * 1e3
        tps = sum(tokens) / sum(times)
        rows.append((mode, ms, sum(tokens) / len(tokens) / args.rows, tps))
        fills.append(fill_s)
        for i in range(args.rows):
            engine.abort(f"r{i}", notify=False)
        del engine
        gc.collect()  # (the engine's reference cycles hold its KV pool and graphs: the next mode's pool would be smaller)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    draft = "" if not args.draft_model else f", draft {args.draft_model.rsplit('/', 1)[-1]}"
    print(
        f"\nEngine steps, {args.dtype}, {args.rows} rows × {args.context} context, streaming budget "
        f"{args.budget}{draft}, γ={args.gamma}, graphs={not args.eager}"
    )
    print("| mode | step ms (median) | tokens/row/step | tok/s | step / AR | tok/s / AR |")
    print("|---|---|---|---|---|---|")
    for mode, ms, tpr, tps in rows:
        print(f"| {mode} | {ms:.2f} | {tpr:.2f} | {tps:.0f} | {ms / rows[0][1]:.2f}× | {tps / rows[0][3]:.2f}× |")
    if args.json:
        keys = ("rows", "context", "gamma", "budget", "dtype", "model", "draft_model")
        table = [dict(mode=m, step_ms=ms, tokens_per_row=tpr, tokens_per_s=tps) for m, ms, tpr, tps in rows]
        with open(args.json, "w") as f:
            json.dump(
                {**{k: getattr(args, k) for k in keys}, "graphs": not args.eager, "fill_s": fills[0], "modes": table},
                f,
                indent=1,
            )


VARIANTS = ("self", "draft", "draft-full", "draft-int8")


def speculative_config(variant: str, args) -> SpeculativeConfig:
    if variant == "self":
        return SpeculativeConfig(
            self_speculate=True, draft_kv="streaming", draft_budget=args.budget, num_draft_tokens=args.gamma
        )
    kv = "full" if variant == "draft-full" else "streaming"
    return SpeculativeConfig(
        draft_model=args.draft_model,
        draft_kv=kv,
        draft_budget=None if kv == "full" else args.budget,
        num_draft_tokens=args.gamma,
        draft_weights="int8" if variant == "draft-int8" else "auto",
    )


if __name__ == "__main__":
    main()
