"""torch's CPU threads: `threads=` / `--threads N` over OMP_NUM_THREADS over the measured default."""

from __future__ import annotations

import pytest
import torch

from redwood.engine.threads import SMALL_MACHINE_CORES, apply_threads, default_threads, resolve_threads
from redwood.errors import ConfigError


def test_default_rule_is_one_thread_on_small_machines_and_torchs_own_above():
    from redwood.engine.threads import _TORCH_DEFAULT

    assert [default_threads(c) for c in (1, 2)] == [1, 1] and default_threads(SMALL_MACHINE_CORES) == 1
    assert [default_threads(c) for c in (3, 16)] == [_TORCH_DEFAULT] * 2


def test_precedence_explicit_then_environment_then_default():
    assert resolve_threads(3, env={"OMP_NUM_THREADS": "2"}) == 3  # an explicit count wins
    assert resolve_threads(None, env={"OMP_NUM_THREADS": "2"}) is None  # the user's variable: torch read it
    assert resolve_threads(None, env={"OMP_NUM_THREADS": " "}) == default_threads()  # (blank: unset)
    assert resolve_threads(None, env={}) == default_threads()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_config_errors(bad):
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        resolve_threads(bad)


def test_apply_sets_torch_and_respects_the_environment(monkeypatch):
    torch.set_num_threads(2)
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(2)
    assert apply_threads(None) == 2  # left as it was
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_threads(None) == default_threads() == torch.get_num_threads()


def test_llm_threads_sets_torch_before_loading(tiny_model_dir, monkeypatch):
    import redwood.engine.loaded as engine_mod
    from redwood import LLM

    seen = []
    real_load = engine_mod.load_model

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "load_model", spy)
    torch.set_num_threads(1)
    llm = LLM(str(tiny_model_dir), threads=2)
    assert seen == [2] and torch.get_num_threads() == 2  # (loading ran on them too)
    from redwood import SamplingParams

    assert len(llm.generate("a b", SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        LLM(str(tiny_model_dir), threads=0)


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_packed_projections_give_the_same_rows_at_1_and_2_threads(kind):
    """A decode step's or a verify's rows (under the gemm threshold) do not depend on the thread count:
    the packed kernels split the output rows among threads, never a sum. (A prefill chunk of ≥ 128 rows
    takes oneDNN's bfloat16 gemm, whose sums do depend on it: docs/perf/cpu.md session 13; not asserted here.)"""
    from redwood.models.cpu_weights import INT4_GEMM_ROWS, PackedLinear

    g = torch.Generator().manual_seed(0)
    p = PackedLinear(torch.randn(1024, 512, generator=g) * 0.05, torch.randn(1024, generator=g), kind)
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 4, 9, 17, 65, INT4_GEMM_ROWS - 1):
            x = torch.randn(rows, 512, generator=g)
            torch.set_num_threads(1)
            one = p(x)
            torch.set_num_threads(2)
            assert torch.get_num_threads() == 2 and torch.equal(p(x), one), rows
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- decode steps' thread count chosen as they run


def drive(policy, times):
    """Feed the policy steps of one shape whose duration depends on the count: times(step, count) → seconds.
    → the counts it ran."""
    counts = []
    for i in range(len(times)):
        n = policy.for_step("s")
        counts.append(n)
        policy.record(n, "s", times[i][n])
    return counts


def test_adaptive_keeps_the_faster_count_and_follows_a_change_in_load():
    from redwood.engine.threads import AdaptiveThreads

    idle, busy = {1: 1.0, 2: 0.65}, {1: 1.1, 2: 2.5}
    p = AdaptiveThreads(base=1, wide=2)
    counts = drive(p, [idle] * 200)
    assert counts[:2] == [2, 1]  # both measured at the start
    # then probes of one thread 64 and 128 steps on (each probe lost, the first included: the interval doubles)
    assert [i for i, c in enumerate(counts) if c == 1] == [1, 65, 193] and p.current == 2
    counts = drive(p, [busy] * 40)  # a core is taken: the step after the jump probes one thread and keeps it
    assert counts[:3] == [2, 1, 1] and p.current == 1 and counts[3:].count(2) == 1  # (a probe after 32)
    counts = drive(p, [idle] * 80)  # the core is back: the next probe of two threads (64 steps on) switches back
    assert p.current == 2 and counts[-1] == 2


def test_adaptive_ignores_differences_within_its_margin():
    from redwood.engine.threads import AdaptiveThreads

    p = AdaptiveThreads(base=1, wide=2)
    drive(p, [{1: 1.0, 2: 1.05}] * 100)
    assert p.current == 2


def test_adaptive_only_where_the_count_is_left_to_redwood():
    from redwood.engine.threads import adaptive_threads

    assert adaptive_threads(None, env={}, cores=2).wide == 2
    assert adaptive_threads(None, env={}, cores=2).base == 1
    assert adaptive_threads(2, env={}, cores=2) is None  # threads given
    assert adaptive_threads(None, env={"OMP_NUM_THREADS": "2"}, cores=2) is None
    assert adaptive_threads(None, env={}, cores=2, enabled=False) is None  # ExecutionConfig(adaptive_threads=False)
    assert adaptive_threads(None, env={}, cores=1) is None
    assert adaptive_threads(None, env={}, cores=SMALL_MACHINE_CORES + 1) is None


class Alternating:
    """A policy that flips the count every decode step (the worst case for exactness)."""

    base, wide = 1, 2
    current = 2  # (steps at the other count are probes: the plan costs do not learn from them)

    def __init__(self):
        self.i, self.seen = 0, []

    def for_step(self, key):
        self.i += 1
        return 1 + self.i % 2

    def record(self, count, key, seconds):
        self.seen.append((count, torch.get_num_threads()))


@pytest.mark.parametrize("sampled", [False, True])
def test_decode_steps_give_the_same_tokens_whatever_the_count(tmp_path, sampled, kquant_variant):
    """A q4k target and draft (the C++ layers): speculative outputs — greedy, and sampled with seeds — are the
    same with every decode step at one thread as with the count flipping every step (prefill at the base). In
    every build of the kernels this CPU runs (`kquant_variant`): each is thread-count exact, so each gets the
    adaptive policy (`LoadedModels.thread_exact_decode`)."""
    import random

    from redwood.kv.policies import FullPolicy
    from redwood.loading import load_model
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.drafters import ModelDrafter
    from redwood.speculation.trees import Tree
    from tests.conftest import random_hf_model, tiny_hf_config
    from tests.engine.driver import RecordingEngine, run_engine

    cfg = tiny_hf_config("qwen2", vocab_size=320, hidden_size=128, intermediate_size=320)
    random_hf_model(cfg, seed=5).save_pretrained(tmp_path / "m")
    target = load_model(tmp_path / "m", weights="q4k").model
    draft = load_model(tmp_path / "m", weights="q4k").model
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=i)
        for i in range(3)
    ]
    before = torch.get_num_threads()
    outs = []
    try:
        for policy in (None, Alternating()):
            torch.set_num_threads(1)
            engine = RecordingEngine.build(
                target, None, drafter=ModelDrafter(draft, FullPolicy(), 320), tree=Tree.chain(3), max_num_seqs=3
            )
            assert engine.models.thread_exact_decode()
            engine.executor.thread_policy = policy
            _, states, _ = run_engine(target, None, prompts, params, engine=engine)
            outs.append([s.output_ids for s in states])
            if policy is not None:
                assert {c for c, _ in policy.seen} == {1, 2} and all(c == n for c, n in policy.seen)
    finally:
        torch.set_num_threads(before)
    assert outs[0] == outs[1] and all(len(o) == 12 for o in outs[0])


class Fixed:
    """A policy that keeps every decode step at one count (base 1, wide 2): only the prefill's count varies."""

    base, wide, current = 1, 2, 1

    def for_step(self, key):
        return 1

    def record(self, count, key, seconds):
        pass


def test_prefill_chunks_run_at_the_wide_count_where_every_forward_is_thread_exact(
    tmp_path, monkeypatch, kquant_variant
):
    """A q4k target and draft (the C++ layers at any length): prefill chunks — prompts past the packed gemm paths'
    128 rows, in chunks of 160 — run at the policy's wide count and give the same tokens as at one thread (no
    policy); with the C++ layers off (`cpu_fused=False`: the Python layers' gemms) they keep the base count."""
    import random

    from redwood.config import ExecutionConfig
    from redwood.engine import executor as executor_mod
    from redwood.kv.policies import FullPolicy
    from redwood.loading import load_model
    from redwood.sampling_params import SamplingParams
    from redwood.speculation.drafters import ModelDrafter
    from redwood.speculation.trees import Tree
    from tests.conftest import random_hf_model, tiny_hf_config
    from tests.engine.driver import RecordingEngine, run_engine

    cfg = tiny_hf_config("qwen2", vocab_size=320, hidden_size=128, intermediate_size=320, max_position_embeddings=512)
    random_hf_model(cfg, seed=5).save_pretrained(tmp_path / "m")
    target = load_model(tmp_path / "m", weights="q4k").model
    draft = load_model(tmp_path / "m", weights="q4k").model
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (300, 140, 20)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    counts = []
    real = executor_mod.prefill_rows
    monkeypatch.setattr(executor_mod, "prefill_rows", lambda *a: counts.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    outs = []
    try:
        for policy, fused in ((None, True), (Fixed(), True), (Fixed(), False)):
            torch.set_num_threads(1)
            for m in (target, draft):
                m.set_execution(ExecutionConfig(cpu_fused=fused))
            engine = RecordingEngine.build(
                target,
                None,
                drafter=ModelDrafter(draft, FullPolicy(), 320),
                tree=Tree.chain(3),
                max_num_seqs=3,
                max_num_batched_tokens=160,
            )
            engine.executor.thread_policy = policy
            assert engine.executor.prefill_wide() == (policy is not None and fused)
            counts.clear()
            _, states, _ = run_engine(target, None, prompts, params, engine=engine)
            outs.append([s.output_ids for s in states])
            assert counts and set(counts) == {2 if engine.executor.prefill_wide() else 1}
    finally:
        torch.set_num_threads(before)
        for m in (target, draft):
            m.set_execution(ExecutionConfig())
    assert outs[0] == outs[1] and all(len(o) == 6 for o in outs[0])
