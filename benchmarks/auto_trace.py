"""Why `--speculative auto` chose what it chose: one prompt kind through plain decoding and the automatic
policy, side by side in one process (issue 37's grid engines: `spec_grid_cpu.build_engines`), with the
policy's view of every step — the plan, its expected tokens and predicted time, the best-scored candidates —
and, per plan, the measured step time and tokens, the draft model's catch-up time, and the planner's own time.

    PYTHONPATH=src python benchmarks/auto_trace.py --kind chat --temperature 0.7 --new-tokens 128 --repeats 2
    PYTHONPATH=src python benchmarks/auto_trace.py --kind code-edit --steps      # every step's line too
    PYTHONPATH=src python benchmarks/auto_trace.py --kind code-edit --batch 4 --temperature 0.7

The last lines are the table: tok/s of AR and auto per repeat, then steps, ms per step and tokens per step by
plan (probes apart; ms measured and predicted, tokens per row achieved and expected). Notes from its use: docs/perf/auto-policy.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import spec_grid_cpu as grid

    from redwood.engine.loaded import LoadedModels
    from redwood.speculation.config import SpeculativeConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="chat", choices=grid.KINDS)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=0, help="which prompt of the kind (the first of a batch)")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together (the kind's next ones)")
    ap.add_argument("--steps", action="store_true", help="print every step's plan and scores")
    args = ap.parse_args()
    g = SimpleNamespace(
        draft_model=grid.DRAFT, draft_weights="auto", self_budget=256, ngram_gamma=4, threads=None,
        prefix_cache=True, separate_engines=False,
    )  # fmt: skip
    base = LoadedModels.load(
        grid.TARGET,
        weights="auto",
        speculative=SpeculativeConfig(draft_model=grid.DRAFT, num_draft_tokens=3, draft_weights="auto"),
    )
    prompts = grid.kind_prompts(args.kind, args.prompt + args.batch, base.tokenizer, 0)[args.prompt :]
    names = ["ar", "auto"]
    specs = {n: grid.config_spec(n, g) for n in names}
    max_len = max(map(len, prompts)) + args.new_tokens + 16
    engines = grid.build_engines(names, specs, base, base.drafter.own_model, g, max_len, max(2, args.batch))
    auto = engines["auto"]
    policy, executor = auto.policy, auto.engine.executor
    planner_s, by_plan, catch_up = [0.0, 0], {}, [0.0]

    plan, observe, catch = policy.plan, policy.observe, executor._catch_up_draft

    def traced_plan(rows, bucket, prefill_backlog_steps=0, backlog_decodes=0):
        t0 = time.perf_counter()
        p = plan(rows, bucket, prefill_backlog_steps, backlog_decodes)
        planner_s[0] += time.perf_counter() - t0
        planner_s[1] += 1
        if args.steps:
            top = sorted(((policy.score(c, rows, bucket)[0], c.name) for c in policy.candidates), reverse=True)[:4]
            print(
                f"step {policy.steps}: {p.name}{' (probe)' if p.probe else ''} expects {p.expected_tokens:.2f} "
                f"tokens in {p.predicted_s * 1e3:.1f} ms; best {', '.join(f'{n} {r:.1f}/s' for r, n in top)}"
            )
        return p

    def traced_observe(rows, ran, tokens, seconds, bucket, catch_up_s=0.0):
        t0 = time.perf_counter()
        key = ran.name + (" (probe)" if ran.probe else "")
        d = by_plan.setdefault(key, [0, 0.0, 0, 0, 0.0, 0.0])
        d[0] += 1
        d[1] += seconds or 0.0
        d[2] += sum(len(t.token_ids) for t in tokens) / len(tokens)  # (tokens per row)
        d[3] += seconds is None
        d[4] += (ran.expected_tokens or 0.0) if ran.name != "ar" else 1.0
        d[5] += ran.predicted_s or 0.0
        observe(rows, ran, tokens, seconds, bucket, catch_up_s)
        planner_s[0] += time.perf_counter() - t0

    def traced_catch(rows):
        t0 = time.perf_counter()
        catch(rows)
        catch_up[0] += time.perf_counter() - t0

    policy.plan, policy.observe, executor._catch_up_draft = traced_plan, traced_observe, traced_catch
    grid.warm_up(engines, base.tokenizer, None)
    rows = []
    for rep in range(args.repeats):
        for n in names:
            out = grid.run_config(engines[n], prompts, args.batch, args.temperature, args.new_tokens, 1, None)
            rows.append((rep + 1, n, out["decode_tokens_per_s"], out["steps"]))
    lens = "/".join(str(len(p)) for p in prompts)
    print(
        f"\n{args.kind}, T = {args.temperature}, batch {args.batch}, {lens}-token prompts, {args.new_tokens} new tokens"
    )
    print("| repeat | config | tok/s | steps |\n|---|---|---|---|")
    for rep, n, tps, steps in rows:
        print(f"| {rep} | {n} | {tps:.2f} | {steps} |")
    print(
        "\n| plan | steps | ms / timed step | predicted ms | tokens / row-step | expected |\n|---|---|---|---|---|---|"
    )
    for k, (steps, secs, toks, untimed, expect, pred) in sorted(by_plan.items(), key=lambda kv: -kv[1][0]):
        timed = max(steps - untimed, 1)
        print(
            f"| {k} | {steps} | {secs * 1e3 / timed:.1f} | {pred * 1e3 / steps:.1f} | {toks / steps:.2f} "
            f"| {expect / steps:.2f} |"
        )
    print(
        f"\ndraft catch-ups {catch_up[0]:.2f} s in all; planner {planner_s[0] * 1e3 / max(planner_s[1], 1):.3f} ms "
        f"a step; acceptance held: {policy.report()['acceptance']}"
    )


if __name__ == "__main__":
    main()
