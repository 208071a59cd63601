"""The automatic policy's own host work per step where prompt lookup carries many tokens a row (issue 40, item 3).

The H100 burst of session 36 (64 × 30,720 essays, 2,048 new, `--speculative auto`) spent 1.35–1.63 ms a
speculative step planning and 0.37–0.48 ms in the policy's bookkeeping, at ~8.4 tokens a row a step, while
`auto_host_cost.py` (whose tiny model emits one or two tokens a row a step) measures ~0.6 ms. This drives
`AutoPolicy.plan` / `observe` alone — no model — over ROWS rows of CONTEXT-token histories that keep repeating
themselves (each row's text is periodic, so prompt lookup proposes its continuation), with the rows emitting
what a verify step would: the proposal's matching head and one token more, ~ACCEPT tokens of each proposal on
average. The policy sees prompt lookup (2–4-grams) and a self-speculation family (fake: its costs only), a
synthetic cost table, graphs off. Prints ms per step for plan and observe, tokens a row a step, then the top
functions (cProfile) of a second pass. GPU_MS: each step waits that long between plan and observe (the device's
step; default 0, 20 with DEFER); DEFER=1: the policy defers each step's shadow scoring into the next step as on a
GPU (`AutoPolicy.defer_scoring`): it runs at the start of that wait, as the executor runs it between the step's
launches and its read-back — the times then show what stays on the step's critical path (a deferred scoring
longer than the wait would show in neither).

FAMILY=draft: the model family is a standalone draft model (full KV, its own calibrated curve; a lagging cache's
catch-up costed on a switch back) — batch 1 with the 0.5B draft, where a plan was 15–25% of an H100 step
(session 38): `FAMILY=draft DEFER=1 GPU_MS=2 ... auto_plan_cost.py 1 300`.

    PYTHONPATH=src:. python benchmarks/auto_plan_cost.py [ROWS] [CONTEXT] [STEPS]     (default 64 30720 200)
"""

from __future__ import annotations

import cProfile
import os
import pstats
import random
import sys
import time
from types import SimpleNamespace

from redwood.engine.batch import Tokens
from redwood.sampling_params import SamplingParams
from redwood.speculation.costs import CostModel, CostTable, ForwardCurve
from redwood.speculation.draftless import NgramDrafter
from redwood.speculation.policy import AutoPolicy

VOCAB = 150_000
ACCEPT = 0.85  # the chance each proposed token is the one the row emits (the burst: ~8 tokens a row a step)


class _Reads:
    def __init__(self, n):
        self.n = n

    def reads(self):
        return self.n


class SelfFamily:
    """Self-speculation as the policy sees it: a family whose draft levels read a 512-token view."""

    family, needs_history, own_model, standalone = "self", False, None, False
    policy = _Reads(512)


class DraftFamily:
    """A standalone draft model as the policy sees it: its own model over its whole context."""

    family, needs_history, own_model, standalone = "draft", False, None, True
    policy = _Reads(None)


def curve(scale: float) -> ForwardCurve:
    tokens = [1, 2, 4, 8, 16, 32]
    lo = [scale * (1 + 0.02 * t) for t in tokens]
    return ForwardCurve(tokens, 16, 32768, lo, [x * 1.5 for x in lo])


def make_rows(rows: int, context: int, rng: random.Random):
    """Rows whose history is a random text that repeats a random period (what essays' lookups find: long
    stretches that occurred before), and the text each row will go on with (its period continued)."""
    out = []
    for slot in range(rows):
        period = [rng.randrange(VOCAB) for _ in range(rng.randrange(400, 1200))]
        text = (period * (context // len(period) + 2))[:context]
        future = (period * 40)[context % len(period) :]
        out.append(
            SimpleNamespace(
                slot=slot,
                params=SamplingParams(max_new_tokens=4096),
                token_ids=text,
                computed=context - 1,
                remaining=4096,
                future=future,
                pos=0,
            )
        )
    return out


def run(steps: int, rows_n: int, context: int, seed: int = 0):
    rng = random.Random(seed)
    ngram = NgramDrafter(VOCAB)
    model_family = DraftFamily() if os.environ.get("FAMILY") == "draft" else SelfFamily()
    policy = AutoPolicy([model_family, ngram])
    policy.costs = CostModel(CostTable(curve(0.02), curve(0.012) if model_family.standalone else None))
    bucket = 1 << max(rows_n - 1, 0).bit_length()  # (the smallest power of two holding the rows)
    defer = os.environ.get("DEFER") == "1"
    policy.defer_scoring = defer
    gpu_s = float(os.environ.get("GPU_MS", "20" if defer else "0")) / 1e3
    rows = make_rows(rows_n, context, rng)
    for r in rows:  # (as the executor does while the prompt prefills)
        ngram.index_prefix(r.slot, r.token_ids, len(r.token_ids))
    plan_s = observe_s = 0.0
    emitted_total = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = policy.plan(rows, bucket)
        job = policy.take_deferred()
        t1 = time.perf_counter()
        if job is not None:
            job()  # (the device works on the step meanwhile)
        if gpu_s:
            time.sleep(max(0.0, gpu_s - (time.perf_counter() - t1)))  # (the rest of the device's step)
        tokens = []
        gamma = 0 if plan.candidate.tree is None else plan.candidate.tree.size - 1
        for r in rows:
            k = 0
            while k < gamma and rng.random() < ACCEPT:
                k += 1
            new = r.future[r.pos : r.pos + k + 1]
            r.pos += len(new)
            r.token_ids.extend(new)
            r.computed += len(new)
            r.remaining -= len(new)
            emitted_total += len(new)
            tokens.append(Tokens(new, ["target"] * len(new), spec=(k, gamma) if gamma else None))
        t2 = time.perf_counter()
        policy.observe(rows, plan, tokens, 0.02, bucket)
        t3 = time.perf_counter()
        plan_s += t1 - t0
        observe_s += t3 - t2
    return plan_s / steps * 1e3, observe_s / steps * 1e3, emitted_total / (steps * rows_n), policy.report()["plans"]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 30720
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    plan_ms, observe_ms, per_row, plans = run(steps, rows, context)
    print(
        f"{rows} rows × {context} context, {steps} steps: plan {plan_ms:.3f} ms, observe {observe_ms:.3f} ms a step; "
        f"{per_row:.2f} tokens a row a step; plans {plans}"
    )
    prof = cProfile.Profile()
    prof.enable()
    run(steps, rows, context, seed=1)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
