"""The Engine's step clock (redwood.engine.step_clock): it counts exactly the steps that decode and prefill
nothing, its phases add up to those steps' wall time, and the timed forward is the executor's own."""

from __future__ import annotations

import time

import pytest

from redwood import SamplingParams
from redwood.engine.engine import Engine
from redwood.engine.step_clock import PHASES, StepClock
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture


def test_the_clock_counts_pure_decoding_steps_and_its_phases_add_up(models):
    target, _, tok = models
    engine = Engine.build(target, tok, max_num_seqs=4, block_size=8, max_num_batched_tokens=64)
    seen = {"pure": 0, "forward_s": 0.0, "wall_s": 0.0}
    execute = engine.executor.execute

    def spy(batch, plan=None, alongside=None):
        result = execute(batch, plan, alongside)
        if batch.decode and not batch.prefill:
            seen["pure"] += 1
            seen["forward_s"] += result.step_s
        return result

    engine.executor.execute = spy
    for i, n in enumerate([40, 70, 12]):  # (70 tokens: a prefill in two chunks, beside decoding rows)
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_new_tokens=9, ignore_eos=True), request_id=f"r{i}")
    before = engine.clock.snapshot()
    while engine.has_unfinished():
        pure_before = seen["pure"]
        t0 = time.perf_counter()
        engine.step()
        if seen["pure"] > pure_before:
            seen["wall_s"] += time.perf_counter() - t0
    got = StepClock.since(before, engine.clock.snapshot())
    assert got["steps"] == seen["pure"] > 0
    assert set(got["ms"]) == set(PHASES)
    assert got["ms"]["forward"] == pytest.approx(1e3 * seen["forward_s"] / seen["pure"], rel=1e-3, abs=2e-3)
    rounding = 0.5e-3 * len(PHASES)  # (ms: each phase and host_ms are rounded to 3 decimals apart)
    total = sum(got["ms"].values()) * got["steps"] / 1e3
    assert total <= seen["wall_s"] + rounding * got["steps"] / 1e3
    assert total == pytest.approx(seen["wall_s"], rel=0.05, abs=2e-3)
    assert got["host_ms"] == pytest.approx(sum(got["ms"].values()) - got["ms"]["forward"], abs=rounding)


def test_no_counted_steps_reads_as_none():
    clock = StepClock()
    assert StepClock.since(clock.snapshot(), clock.snapshot()) == {"steps": 0, "ms": {}, "host_ms": None}
    clock.start()
    clock.lap("plan")
    clock.finish(counted=False)
    assert clock.steps == 0
