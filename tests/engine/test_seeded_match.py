"""Seeds fix the output: a seeded sampled request gives the same tokens under autoregressive decoding and
under every speculation plan with the `match` verifier (position noise, the engine's default).

Why it holds: the token at absolute position P is drawn by inverse CDF with the seed's number at P
(`RowRandom.positional`) whether a plain step samples it or a match step verifies it (the target's own
draw at each node, keyed by the position after it), and the drafts only decide how many of those draws
one step emits. It is exact wherever the verify forward's logits equal the decode forward's; on these
tiny float32 CPU models they differ in the last bits at most, and an inverse-CDF draw lands within
~1e-7 of a boundary with probability ~1e-7 per token.

The conftest's clear-margin target and its noisy copy as the draft model (`tests.engine.test_engine`).
"""

from __future__ import annotations

import pytest

from redwood import LLM, Engine, SamplingParams
from redwood.errors import ConfigError
from redwood.kv.policies import FullPolicy, StreamingPolicy
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree, resolve_tree
from tests.conftest import save_target_and_draft
from tests.engine.driver import repetitive_prompts, run_engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    """(folder with target/ and draft/, target Transformer, draft Transformer, tokenizer)."""
    root = tmp_path_factory.mktemp("seeded-match")
    save_target_and_draft(root, tokenizer, noise=0.01)
    target, draft = LLM(str(root / "target")), LLM(str(root / "draft"))
    return root, target.model, draft.model, target.tokenizer


PROMPTS = repetitive_prompts(3, seed=8, copies=(2, 4), tail=(1, 9))
# two sampled requests with different seeds and a greedy one beside them
PARAMS = [
    SamplingParams(max_new_tokens=28, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0),
    SamplingParams(max_new_tokens=28, ignore_eos=True, temperature=0.8, top_p=0.9, seed=12345),
]

PLANS = {
    "draft-chain3": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), Tree.chain(3)),
    "draft-tree": lambda t, d: (ModelDrafter(d, FullPolicy(), 320), resolve_tree("generic-16")),
    "self-streaming-chain3": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), Tree.chain(3)),
    "self-streaming-tree": lambda t, d: (SelfDrafter(t, StreamingPolicy(2, 10)), resolve_tree("chains:2x3")),
}


@pytest.fixture(scope="module")
def ar_outputs(pair):
    _, target, _, tok = pair
    _, states, _ = run_engine(target, tok, PROMPTS, PARAMS)
    return [s.output_ids for s in states]


def _accepted_and_drafted(states) -> tuple[int, int]:
    stats = [s.stats.spec for s in states]
    return sum(s.accepted for s in stats), sum(s.drafted for s in stats)


@pytest.mark.parametrize("plan", list(PLANS))
def test_seeded_requests_give_the_ar_tokens_under_every_match_plan(pair, ar_outputs, plan):
    """Token for token the AR output, with the requests arriving at other steps and sharing two slots
    (other batch rows, other slots than the AR run's); drafts were both accepted and rejected."""
    _, target, draft, tok = pair
    drafter, tree = PLANS[plan](target, draft)
    _, states, _ = run_engine(
        target, tok, PROMPTS, PARAMS, drafter=drafter, tree=tree, verifier="match", arrivals=[0, 1, 3], max_num_seqs=2
    )
    assert [s.output_ids for s in states] == ar_outputs
    accepted, drafted = _accepted_and_drafted(states)
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("temperature", [0.8, 0.3])
def test_seeded_requests_give_the_ar_tokens_with_ngram_drafts(pair, temperature):
    """The draftless drafter through `SpeculativeConfig(draftless="ngram", verifier="match")` and `LLM`.
    These random models rarely repeat a phrase when sampling at 0.8 (the drafts are all rejected); at 0.3
    sampled rows accept some."""
    root, *_ = pair
    params = [
        SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=temperature, top_p=0.9, seed=s)
        for s in (1, 2, 3)
    ]
    ar = LLM(str(root / "target")).generate(PROMPTS, params)
    spec = SpeculativeConfig(draftless="ngram", num_draft_tokens=3, ngram_min=1, verifier="match")
    outs = LLM(str(root / "target"), speculative=spec).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    assert all(o.stats["speculative"]["drafted"] > 0 for o in outs)
    if temperature < 0.5:
        assert sum(o.stats["speculative"]["accepted"] for o in outs) > 0


def test_a_preempted_request_resamples_the_same_tokens(pair, ar_outputs):
    """A pool too small for all three: requests are preempted and re-prefilled (prompt + output so far);
    the token a re-prefill samples sits at the position its prefill ends at, as in the AR run."""
    _, target, _, tok = pair
    c = target.config
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 8 * 4
    engine = Engine.build(target, tok, max_num_seqs=3, block_size=8, kv_cache_memory=(9 + 1) * per_block / 2**30)
    preempted, schedule = [], engine.scheduler.schedule

    def counting():
        out = schedule()
        preempted.append(len(out.preempted))
        return out

    engine.scheduler.schedule = counting
    _, states, _ = run_engine(target, tok, PROMPTS, PARAMS, engine=engine)
    assert sum(preempted) > 0, "the pool did not preempt"
    assert [s.output_ids for s in states] == ar_outputs


def test_counter_noise_keeps_the_old_streams_and_bad_noise_is_a_config_error(pair, ar_outputs):
    _, target, _, tok = pair
    engine = Engine.build(target, tok, sampling_noise="counter", max_num_seqs=3)
    assert engine.executor.sampler.noise == "counter"
    _, states, _ = run_engine(target, tok, PROMPTS, PARAMS, engine=engine)
    outs = [s.output_ids for s in states]
    assert outs[1] == ar_outputs[1]  # greedy: no random numbers
    assert outs[0] != ar_outputs[0] and outs[2] != ar_outputs[2]  # the other stream
    with pytest.raises(ConfigError, match="sampling_noise"):
        Engine.build(target, tok, sampling_noise="gumbel")


@pytest.mark.parametrize("policy", ["cycled", "live"])
def test_seeded_requests_give_the_ar_tokens_under_the_auto_policy(pair, ar_outputs, policy, monkeypatch, tmp_path):
    """The automatic policy with its default verifier ("auto": match for sampled chains under position noise):
    the same tokens as AR whatever it plans — its candidates switched at every step ("cycled"), or its own
    choices with probes ("live")."""
    import redwood.speculation.costs_cache as cache
    from redwood.speculation.draftless import NgramDrafter
    from tests.engine.driver import RecordingEngine
    from tests.engine.test_auto_policy import cycle_plans

    monkeypatch.setattr(cache, "costs_dir", lambda: tmp_path / "costs")
    if policy == "cycled":
        cycle_plans(monkeypatch, order=[0, 1, 3, 5, 9, 10, 12])  # ar, draft γ1 γ3 γ5, ngram γ1 γ2 γ4
    _, target, draft, tok = pair
    drafters = [ModelDrafter(draft, FullPolicy(), 320), NgramDrafter(320, 1, 3)]
    engine = RecordingEngine.build(target, tok, auto_drafters=drafters, max_num_seqs=2, block_size=8)
    _, states, _ = run_engine(target, tok, PROMPTS, PARAMS, arrivals=[0, 1, 3], engine=engine)
    assert [s.output_ids for s in states] == ar_outputs
    plans = {name for s in states for name in s.stats.spec.plans}
    assert "ar" in plans and any(p.startswith("draft") for p in plans)
