"""The compile clock (`engine.compile_clock`) and the executor's booking of kernel compiles as one-time costs."""

from __future__ import annotations

import time
import types

import pytest

from redwood import SamplingParams
from redwood.engine import compile_clock
from redwood.kv.policies import FullPolicy
from redwood.speculation.drafters import ModelDrafter
from redwood.speculation.draftless import NgramDrafter
from redwood.speculation.policy import AutoPolicy
from tests.engine.driver import repetitive_prompts, run_engine
from tests.engine.test_auto_policy import ARRIVALS, auto_engine, costs_in_tmp, cycle_plans  # noqa: F401
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture


def fresh_state():
    return {"installed": False, "total": 0.0, "start": None}


def test_the_clock_times_compiles_between_the_hooks_and_chains_the_hooks_it_replaces(monkeypatch):
    calls = []
    runtime = types.SimpleNamespace(
        jit_cache_hook=lambda **kw: calls.append(("pre", kw["key"])) or False,
        jit_post_compile_hook=lambda **kw: calls.append(("post", kw["key"])),
    )
    monkeypatch.setattr(compile_clock, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(compile_clock, "_state", fresh_state())
    assert compile_clock.install() and compile_clock.install()  # (idempotent: the hooks wrap once)
    assert compile_clock.seconds() == 0.0
    assert runtime.jit_cache_hook(key=1) is False  # (the wrapped hook's answer: never a true one of its own)
    time.sleep(0.02)
    runtime.jit_post_compile_hook(key=1)
    runtime.jit_post_compile_hook(key=2)  # (an end without a start — e.g. after a failed compile — adds nothing)
    assert calls == [("pre", 1), ("post", 1), ("post", 2)]
    assert 0.02 <= compile_clock.seconds() < 1.0


@pytest.mark.parametrize(
    "triton", [None, types.SimpleNamespace(), types.SimpleNamespace(knobs=types.SimpleNamespace())]
)
def test_without_triton_or_its_hooks_the_clock_stays_at_zero(monkeypatch, triton):
    monkeypatch.setattr(compile_clock, "triton", triton)
    monkeypatch.setattr(compile_clock, "_state", fresh_state())
    assert not compile_clock.install() and compile_clock.seconds() == 0.0


def test_the_installed_triton_takes_the_hooks(monkeypatch):
    triton = pytest.importorskip("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no runtime compile hooks")
    monkeypatch.setattr(runtime, "jit_cache_hook", None)  # (restored after the test, as the hooks were)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compile_clock, "_state", fresh_state())
    assert compile_clock.install()
    assert callable(runtime.jit_cache_hook) and callable(runtime.jit_post_compile_hook)
    assert runtime.jit_cache_hook(key=0) is None


def test_a_catch_ups_compiles_are_left_out_of_what_the_policy_learns_and_booked_as_one_time(models, monkeypatch):
    """Plans switching every step make the draft model catch up again and again; each catch-up here also
    "compiles" (the fake clock advances by a real 30 ms sleep, as Triton's hooks would time a compile): the
    policy learns every catch-up without those 30 ms, the engine books them with its one-time costs
    (`Engine.capture_s`, which the bench's clocks leave out), and the output still equals AR's."""
    from redwood.engine.executor import Executor

    target, draft, tok = models
    prompts = repetitive_prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in prompts]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS[:4], max_num_seqs=2, block_size=8)
    cycle_plans(
        monkeypatch, order=[0, 1, 2]
    )  # (plain decoding, the draft model's γ 1, γ 2: a catch-up every third step)
    clock = [0.0]
    monkeypatch.setattr(compile_clock, "seconds", lambda: clock[0])
    catch_up, compiled = Executor._catch_up_draft, []

    def compiling_catch_up(self, rows):
        lagging = any(self._draft_valid[r.slot] < r.computed - 1 for r in rows)
        catch_up(self, rows)
        if lagging:
            t = time.perf_counter()
            time.sleep(0.03)
            compiled.append(time.perf_counter() - t)
            clock[0] += compiled[-1]

    monkeypatch.setattr(Executor, "_catch_up_draft", compiling_catch_up)
    learnt, observe = [], AutoPolicy.observe

    def recording(self, rows, ran, tokens, seconds, bucket, catch_up_s=0.0, capture_s=0.0):
        if catch_up_s:
            learnt.append(catch_up_s)
        return observe(self, rows, ran, tokens, seconds, bucket, catch_up_s, capture_s)

    monkeypatch.setattr(AutoPolicy, "observe", recording)
    engine = auto_engine(target, tok, [ModelDrafter(draft, FullPolicy(), 320), NgramDrafter(320, 1, 3)], max_num_seqs=2)
    _, spec, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS[:4], engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert len(compiled) >= 3 and len(learnt) >= len(compiled)  # (every draft step reports its catch-up, if any)
    assert all(0 < s < 0.03 for s in learnt), learnt  # (a tiny model's catch-up: milliseconds, the sleep left out)
    assert engine.capture_s == pytest.approx(sum(compiled))  # (no graph captures on a CPU: the compiles alone)
