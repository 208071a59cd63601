"""Host time the automatic policy adds to a decoding step (docs/perf/auto-policy.md item 21).

An AR engine and an auto engine (self-speculation over StreamingLLM + prompt lookup) on the test suite's tiny
model, ROWS requests (default 1) of PROMPT tokens each, 300 new, one thread. The auto engine's plans are forced
to plain decoding (every plan expects one token) and its probes switched off, so the two run the same forwards
and the difference is the policy's own work per step (planning, shadow scoring, bookkeeping). A third engine
plans as usual but runs prompt lookup's γ 16 chain whatever it picks (prompts that repeat themselves: most of
each proposal is accepted, ~10 tokens a row a step, as in the H100 burst of session 35). Prints ms per decode
step and the step clock's phases (`Engine.clock`), twice each.

    PYTHONPATH=src:. python benchmarks/auto_host_cost.py [PROMPT] [ROWS]      (default 2000 1; the burst: 2000 64)
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ["REDWOOD_HOME"] = tempfile.mkdtemp()  # (the auto engine's calibration: not the user's cache)

from redwood import LLM, SamplingParams  # noqa: E402
from redwood.engine.engine import Engine  # noqa: E402
from redwood.engine.step_clock import StepClock  # noqa: E402
from redwood.kv.policies import StreamingPolicy  # noqa: E402
from redwood.speculation import policy as policy_module  # noqa: E402
from redwood.speculation.drafters import SelfDrafter  # noqa: E402
from redwood.speculation.draftless import NgramDrafter  # noqa: E402
from tests.conftest import make_tokenizer, save_target_and_draft  # noqa: E402

NEW_TOKENS = 300


def per_step_ms(engine: Engine, prompts: list[list[int]]) -> tuple[float, int, str]:
    """Mean wall time of the decode steps (those after every prompt's prefill), how many, and their phases."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    steps, total = 0, 0.0
    before = None
    while engine.has_unfinished():
        prefilled = not engine.scheduler.waiting and not any(s.is_prefilling for s in engine.scheduler.running)
        if prefilled and engine.num_steps > 3 and before is None:
            before = engine.clock.snapshot()
        t = time.perf_counter()
        engine.step()
        if before is not None:
            steps, total = steps + 1, total + time.perf_counter() - t
    phases = StepClock.since(before, engine.clock.snapshot())
    text = ", ".join(f"{p} {v:.3f}" for p, v in phases["ms"].items())
    return total / steps * 1e3, steps, text


def repetitive(rng: random.Random, length: int) -> list[int]:
    """A prompt that mostly repeats a 60-token passage (prompt lookup finds long matches)."""
    base = [rng.randrange(3, 300) for _ in range(60)]
    out: list[int] = []
    while len(out) < length:
        out += base if rng.random() < 0.7 else [rng.randrange(3, 300) for _ in range(20)]
    return out[:length]


def force(policy, name: str) -> None:
    """Plan as usual (its host work counts), then run candidate `name` instead."""
    cand = next(c for c in policy.candidates if c.name == name)
    plan = policy.plan

    def forced(*args, **kwargs):
        p = plan(*args, **kwargs)
        return policy_module.Plan(cand, expected_tokens=p.expected_tokens, predicted_s=p.predicted_s)

    policy.plan = forced


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    tok = make_tokenizer()
    root = Path(tempfile.mkdtemp())
    save_target_and_draft(root, tok, noise=0.01, max_position_embeddings=length + 1000)
    target = LLM(str(root / "target")).model
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(length)] for _ in range(rows)]
    policy_module.PROBE_EVERY = 10**9  # (no probes: their steps are real work, not the policy's overhead)
    settings = dict(max_num_seqs=max(4, rows), block_size=16, max_model_len=length + NEW_TOKENS + 100)
    for _ in range(2):
        ms, n, phases = per_step_ms(Engine.build(target, tok, **settings), prompts)
        print(f"ar:   {ms:.3f} ms a step over {n} steps ({phases})")
        drafters = [SelfDrafter(target, StreamingPolicy(4, 60)), NgramDrafter(320)]
        auto = Engine.build(target, tok, auto_drafters=drafters, **settings)
        # (every plan expects one token: AR wins)
        auto.policy.expected_by_gamma = lambda family, rows, p=auto.policy: [1.0] * (p.depth[family] + 1)
        for probe in auto.policy._probes.values():
            probe.due = 10**9
        ms, n, phases = per_step_ms(auto, prompts)
        print(f"auto: {ms:.3f} ms a step over {n} steps ({phases}); plans {auto.policy.report()['plans']}")
        drafters = [SelfDrafter(target, StreamingPolicy(4, 60)), NgramDrafter(320)]
        auto = Engine.build(target, tok, auto_drafters=drafters, **settings)
        force(auto.policy, "ngram γ16")
        ms, n, phases = per_step_ms(auto, [repetitive(rng, length) for _ in range(rows)])
        print(f"auto, prompt lookup γ 16 run: {ms:.3f} ms a step over {n} steps ({phases})")


if __name__ == "__main__":
    main()
