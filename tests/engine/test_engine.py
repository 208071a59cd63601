"""The Engine under continuous batching: a request's output never depends on what runs beside it.

Tiny random Qwen2-style models on the CPU in float32 (the conftest's clear-margin target and a noisy
copy as the standalone draft). Each request's reference is its own run alone in a fresh engine.
"""

from __future__ import annotations

import random

import pytest

from redwood import Engine, SamplingParams
from redwood.errors import ConfigError, ContextLengthError
from redwood.kv.policies import FullPolicy, SnapKVPolicy, StreamingPolicy
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree, resolve_tree
from tests.conftest import save_target_and_draft
from tests.engine.driver import run_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    from redwood import LLM

    root = tmp_path_factory.mktemp("engine-models")
    save_target_and_draft(root, tokenizer, noise=0.01)
    target, draft = LLM(str(root / "target")), LLM(str(root / "draft"))
    return target.model, draft.model, target.tokenizer


def _prompts(n, seed, lo=5, hi=90):
    g = random.Random(seed)
    return [[g.randrange(3, 300) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


MODES = {
    "ar": lambda t, d: (None, None),
    "chain-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
    "chain-draft-streaming": lambda t, d: (ModelDrafter(d, StreamingPolicy(4, 12), 320), Tree.chain(4)),
    "chain-draft-snapkv": lambda t, d: (ModelDrafter(d, SnapKVPolicy(16, window=4), 320), Tree.chain(2)),
    "chain-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), Tree.chain(3)),
    "chain-self-snapkv": lambda t, d: (SelfDrafter(t, SnapKVPolicy(16, window=4)), Tree.chain(3)),
    "tree-self-streaming": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), resolve_tree("generic-16")),
    "tree-draft-full": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), resolve_tree("chains:2x3")),
}


def _alone(models, mode, prompts, params):
    target, draft, tok = models
    out = []
    for p, q in zip(prompts, params):
        drafter, tree = MODES[mode](target, draft)
        _, states, _ = run_engine(target, tok, [p], [q], drafter=drafter, tree=tree, max_num_seqs=1)
        out.append(states[0].output_ids)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_continuous_batching_greedy_equals_each_request_alone(models, mode):
    """Ragged prompts arriving at random steps, mixed max_new_tokens, 16-token prefill budgets per step,
    two requests aborted a few steps after arriving, 3 slots for 8 requests: every request that ran to the
    end equals its greedy output alone, an aborted one holds a prefix of it, every block is free after."""
    target, draft, tok = models
    prompts = _prompts(8, seed=1)
    rng = random.Random(2)
    params = [SamplingParams(max_new_tokens=rng.randrange(3, 25), ignore_eos=True) for _ in prompts]
    arrivals = sorted(rng.randrange(0, 30) for _ in prompts)
    drafter, tree = MODES[mode](target, draft)
    engine, states, _ = run_engine(
        target,
        tok,
        prompts,
        params,
        drafter=drafter,
        tree=tree,
        arrivals=arrivals,
        aborts={2: arrivals[2] + 1, 5: arrivals[5] + 4},
        max_num_seqs=3,
        block_size=8,
        max_num_batched_tokens=16,
    )
    ref = _alone(models, mode, prompts, params)
    for i, (s, want) in enumerate(zip(states, ref)):
        if i in (2, 5):
            assert s.finish_reason == "abort" and s.output_ids == want[: len(s.output_ids)]
        else:
            assert s.output_ids == want and s.finish_reason == "length", f"request {i}"
    assert engine.pool.num_used == 0 and int(engine.cache.live.sum()) == 0
    assert not engine.has_unfinished()


@pytest.mark.parametrize("mode", ["ar", "chain-self-streaming", "chain-draft-snapkv"])
def test_prefill_first_changes_the_order_not_the_output(models, mode, monkeypatch):
    """prefill_first=True: a step with prompts to prefill runs them alone (no decoding row beside them), and every
    request's greedy output is still its output alone."""
    from redwood.engine.scheduler import Scheduler

    target, draft, tok = models
    prompts = _prompts(6, seed=11)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    drafter, tree = MODES[mode](target, draft)
    steps = []  # (prefill chunks, decoding rows) of every step
    schedule = Scheduler.schedule

    def recorded(self):
        out = schedule(self)
        steps.append((len(out.prefill), len(out.decode)))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recorded)
    engine, states, _ = run_engine(
        target,
        tok,
        prompts,
        params,
        drafter=drafter,
        tree=tree,
        arrivals=[0, 0, 0, 4, 4, 9],
        max_num_seqs=6,
        block_size=8,
        max_num_batched_tokens=16,
        prefill_first=True,
    )
    assert not any(p and d for p, d in steps) and any(d for _, d in steps)
    monkeypatch.undo()
    assert [s.output_ids for s in states] == _alone(models, mode, prompts, params)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("mode", ["ar", "chain-draft-snapkv", "tree-self-streaming"])
def test_seeded_sampling_does_not_depend_on_the_batch(models, mode):
    """A seeded sampled request gives the same tokens alone and beside others arriving at other steps
    (greedy and sampled neighbours, so the step's verifier kind changes under it)."""
    target, draft, tok = models
    prompts = _prompts(5, seed=3)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_new_tokens=15, ignore_eos=True) for i in range(4)
    ] + [SamplingParams(max_new_tokens=9, ignore_eos=True)]
    drafter, tree = MODES[mode](target, draft)
    _, states, _ = run_engine(
        target, tok, prompts, params, drafter=drafter, tree=tree, arrivals=[0, 2, 2, 7, 1], max_num_seqs=4, block_size=8
    )
    ref = _alone(models, mode, prompts, params)
    assert [s.output_ids for s in states] == ref
    other = [SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_new_tokens=15, ignore_eos=True)]
    assert _alone(models, mode, prompts[:1], other) != ref[:1]


@pytest.mark.parametrize("mode", ["ar", "chain-self-snapkv", "chain-draft-streaming"])
def test_preemption_under_a_tiny_pool_completes_every_request(models, mode):
    """A pool of 12 blocks of 8 tokens for 6 requests of up to 90 + 30 tokens: rows get preempted
    (recomputed later) and every request still completes with its greedy output alone."""
    target, draft, tok = models
    prompts = _prompts(6, seed=4, lo=30, hi=60)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True) for _ in prompts]
    drafter, tree = MODES[mode](target, draft)
    engine = _tiny_pool_engine(target, tok, drafter, tree, blocks=12)
    _, states, _ = run_engine(target, tok, prompts, params, engine=engine)
    preempted = sum(rec for rec in engine.preemptions.values())
    assert preempted > 0, "the pool was not small enough to preempt"
    assert [s.output_ids for s in states] == _alone(models, mode, prompts, params)
    assert engine.pool.num_used == 0


def _tiny_pool_engine(target, tok, drafter, tree, blocks):
    from tests.engine.driver import RecordingEngine

    per_block = sum(
        2 * m.config.num_layers * m.config.num_kv_heads * m.config.head_dim * 8 * 4
        for m in [target] + ([drafter.own_model] if drafter is not None and drafter.own_model else [])
    )
    engine = RecordingEngine.build(
        target,
        tok,
        drafter=drafter,
        tree=tree,
        max_num_seqs=4,
        block_size=8,
        kv_cache_memory=(blocks + 1) * per_block / 2**30,
    )
    assert engine.pool.num_blocks == blocks
    engine.preemptions = {}
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        for s in out.preempted:
            engine.preemptions[s.request_id] = engine.preemptions.get(s.request_id, 0) + 1
        return out

    engine.scheduler.schedule = counting
    return engine


def test_buckets_and_rows(models):
    """Steps run on the smallest bucket holding every generating slot; idle slots read nothing."""
    target, _, tok = models
    engine = Engine.build(target, tok, max_num_seqs=6, block_size=8)
    assert engine.executor.buckets == [1, 2, 4, 6]
    for i, p in enumerate(_prompts(3, seed=5)):
        engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id=f"x{i}")
    while engine.has_unfinished():
        engine.step()
    assert set(n for _, n in engine.executor.runners) <= {1, 2, 4}
    assert engine.pool.num_used == 0 and int(engine.cache.live.sum()) == 0
    assert (engine.cache.block_table == engine.cache.trash_page).all()


def test_engine_errors(models):
    target, _, tok = models
    engine = Engine.build(target, tok, max_num_seqs=2, block_size=8, max_model_len=64)
    engine.add_request([5, 6], request_id="a")
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request([5, 6], request_id="a")
    with pytest.raises(ContextLengthError, match="empty"):
        engine.add_request([])
    with pytest.raises(ContextLengthError, match="context is 64"):
        engine.add_request(list(range(3, 70)))
    with pytest.raises(ContextLengthError, match="outside the vocabulary"):
        engine.add_request([5, 10**6])
    with pytest.raises(ConfigError, match="SamplingParams"):
        engine.add_request([5], params={"temperature": 1})
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("nope")
    (delta,) = engine.step()
    assert delta.request_id == "a" and delta.finish_reason == "abort" and not engine.has_unfinished()
    for bad in (
        dict(max_num_seqs=0),
        dict(block_size=-1),
        dict(kv_cache_memory=0),
        dict(max_model_len=10**9),
        dict(max_num_batched_tokens=True),
    ):
        with pytest.raises(ConfigError):
            Engine.build(target, tok, **bad)


def test_greedy_verifier_refuses_sampled_requests(models):
    target, _, tok = models
    engine = Engine.build(
        target,
        tok,
        drafter=SelfDrafter(target, StreamingPolicy(2, 10)),
        tree=Tree.chain(2),
        verifier="greedy",
        max_num_seqs=2,
    )
    with pytest.raises(ConfigError, match="greedy verifier"):
        engine.add_request([5, 6, 7], SamplingParams(temperature=0.7))


def test_requests_stream_text_and_finish(models):
    """Deltas concatenate to the final text; the last one carries stats and the prompt."""
    target, _, tok = models
    engine = Engine.build(target, tok, max_num_seqs=2, block_size=8)
    rid = engine.add_request("hello world", SamplingParams(max_new_tokens=12, ignore_eos=True))
    text, ids, last = "", [], None
    while engine.has_unfinished():
        for d in engine.step():
            assert d.request_id == rid
            text, ids, last = text + d.text, ids + d.token_ids, d
    assert last.finish_reason == "length" and len(ids) == 12 and last.stats["generated_tokens"] == 12
    assert last.prompt_token_ids == tok.encode("hello world")
    assert text and tok.decode(ids, skip_special_tokens=True).startswith(text)  # (an incomplete UTF-8 tail is held)


def test_engine_config_is_validated_on_construction():
    from redwood.config import EngineConfig

    assert EngineConfig().max_num_seqs == 256
    for bad, match in (
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=2.5), "block_size"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(kv_cache_memory=-1), "kv_cache_memory"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(prefill_first=1), "prefill_first"),
        (dict(cuda_graphs=1), "cuda_graphs"),
    ):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(**bad)
    with pytest.raises(ConfigError, match="unknown engine setting.*max_seqs"):
        Engine.build(None, max_seqs=2)


@pytest.mark.parametrize("name", ["draft_weights", "draft_quant"])
def test_draft_weights_keyword_says_where_it_moved(name, tmp_path):
    """The draft's weight format is SpeculativeConfig.draft_weights: the old keywords (Engine / LLM's
    draft_weights, the config's draft_quant) say so, before anything loads (the model path does not exist)."""
    from redwood import LLM
    from redwood.engine.engine import engine_config

    moved = r"draft_weights moved to SpeculativeConfig\(draft_weights=\.\.\.\)"
    with pytest.raises(ConfigError, match=moved):
        engine_config(**{name: "int8"})
    with pytest.raises(ConfigError, match=moved):
        Engine.from_pretrained(str(tmp_path / "nope"), **{name: "int8"})
    with pytest.raises(ConfigError, match=moved):
        LLM(str(tmp_path / "nope"), **{name: "int8"})


def test_engines_share_loaded_models_and_each_sizes_its_own_kv(models):
    """Two engines over one LoadedModels: each allocates its KV when built (no lazy allocation), within its
    own memory share, and both generate the same greedy tokens."""
    from redwood.config import EngineConfig
    from redwood.engine.loaded import LoadedModels

    target, _, tok = models
    shared = LoadedModels.of(target, tok)
    per_block = 2 * target.config.num_layers * target.config.num_kv_heads * target.config.head_dim * 8 * 4
    small = Engine(shared, EngineConfig(max_num_seqs=2, block_size=8, kv_cache_memory=21 * per_block / 2**30))
    big = Engine(shared, EngineConfig(max_num_seqs=2, block_size=8))
    assert small.pool.num_blocks == 20 and big.pool.num_blocks > 20
    assert small.cache.k.data_ptr() != big.cache.k.data_ptr() and small.model is big.model
    outs = []
    for engine in (small, big):
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), request_id="a")
        ids = []
        while engine.has_unfinished():
            ids += [t for d in engine.step() for t in d.token_ids]
        outs.append(ids)
    assert outs[0] == outs[1] and len(outs[0]) == 6
    with pytest.raises(ConfigError, match="EngineConfig"):
        Engine(shared, {"max_num_seqs": 2})


def test_an_llm_builds_its_engine_on_first_use(tiny_model_dir):
    from redwood import LLM

    llm = LLM(str(tiny_model_dir), max_num_seqs=2)
    assert llm._engine is None  # (tools borrowing llm.model build engines of their own)
    assert llm.engine.max_num_seqs == 2 and llm.engine is llm.engine
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny_model_dir), max_model_len=10**9)
