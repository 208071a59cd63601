"""Draftless drafting (redwood.speculation.draftless): the n-gram index's matching on edge cases, the drafter's
proposals and its plain steps when nothing matches, greedy speculation == greedy AR through the Engine (a
repetitive workload, so proposals are accepted), seeded sampling through it, and the configuration / CLI errors.
(The one-hot draft distribution's exactness under rejection sampling: tests/sample/test_verifiers_exact.py,
draft "onehot"; through the engine: tests/bench/test_lossless.py, method ngram-chain3.)"""

from __future__ import annotations

import random

import pytest
import torch

from redwood import SamplingParams
from redwood.errors import ConfigError
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.draftless import _TAIL, NgramDrafter, NgramIndex
from redwood.speculation.trees import Tree
from tests.engine.driver import repetitive_prompts, run_engine
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture


def index(tokens, lo=2, hi=4) -> NgramIndex:
    ix = NgramIndex(lo, hi)
    ix.extend(tokens)
    return ix


def test_no_match_proposes_nothing():
    assert index([1, 2, 3, 4, 5]).propose(3) == []
    assert index([]).propose(3) == []


def test_a_history_shorter_than_n_proposes_nothing():
    assert index([7], lo=2).propose(3) == [] and index([7, 7], lo=3, hi=4).propose(2) == []


def test_the_longest_suffix_wins_over_a_shorter_more_recent_one():
    # suffix (1, 2, 3) occurred at 0..2 (then 9); (2, 3) alone occurred more recently (then 8)
    assert index([1, 2, 3, 9, 2, 3, 8, 1, 2, 3]).propose(1) == [9]
    assert index([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], lo=2, hi=2).propose(1) == [8]


def test_repeated_ngrams_propose_the_most_recent_continuation():
    assert index([5, 6, 1, 5, 6, 2, 5, 6]).propose(1) == [2]


def test_a_match_at_the_very_end_continues_its_period():
    # the latest earlier (7, 7) ends one token before the end: its continuation is the suffix itself, repeated
    assert index([3, 7, 7, 7]).propose(4) == [7, 7, 7, 7]
    assert index([1, 2, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]
    assert index([4, 1, 2, 3, 1, 2, 3], lo=3, hi=3).propose(4) == [1, 2, 3, 1]


def test_the_index_grows_incrementally_as_a_whole_rebuild_would():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(200)]
    ix = NgramIndex(1, 3)
    for i, t in enumerate(tokens):
        ix.extend([t])
        assert ix.propose(3) == index(tokens[: i + 1], 1, 3).propose(3)


def _reference_proposal(tokens, k, lo, hi):
    """Prompt lookup written plainly: the longest suffix of hi..lo tokens at its latest earlier occurrence."""
    ends = {}
    for L in range(len(tokens)):
        for n in range(lo, min(hi, L) + 1):
            ends[tuple(tokens[L - n : L])] = L
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        end = ends.get(tuple(tokens[len(tokens) - n :]))
        if end is not None:
            out = []
            for j in range(k):
                i = end + j
                out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
            return out
    return []


@pytest.mark.parametrize("seed", range(6))
def test_bulk_and_token_by_token_indexing_propose_as_the_plain_definition(seed):
    """The index hashes n-grams into ints and indexes a long addition (a prompt) in one vectorized pass: whatever
    the sizes of the additions, its proposals are the plain definition's (token ids up to a large vocabulary's)."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 7, 151_936])
    tokens = [rng.randrange(vocab) if vocab > 7 and rng.random() < 0.5 else rng.randrange(4) for _ in range(400)]
    lo, hi = rng.choice([(1, 3), (2, 4), (3, 6)])
    ix, pos = NgramIndex(lo, hi), 0
    while pos < len(tokens):
        step = rng.choice([1, 2, 63, 64, 150])
        ix.extend(tokens[pos : pos + step])
        pos = min(pos + step, len(tokens))
        assert ix.propose(5) == _reference_proposal(tokens[:pos], 5, lo, hi), pos


@pytest.mark.parametrize("seed", range(4))
def test_asking_again_at_any_length_answers_as_a_fresh_question(seed):
    """A step asks the same index twice (the shadow scorer at the family's depth, `prepare` at the plan's γ) and
    `propose` answers the second from the first: at every length, before and after the index grows, and for a
    proposal that runs past the end (a period), its answers are the plain definition's; a caller changing an answer
    changes no later one."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(120)]
    ix, pos = NgramIndex(1, 3), 0
    while pos < len(tokens):
        step = rng.choice([1, 2, 5])
        ix.extend(tokens[pos : pos + step])
        pos = min(pos + step, len(tokens))
        for k in rng.sample([0, 1, 3, 7, 16, 30], 6):  # (longest first or not: both orders)
            got = ix.propose(k)
            assert got == _reference_proposal(tokens[:pos], k, 1, 3), (pos, k)
            got.append(-1)


@pytest.mark.parametrize("seed", range(4))
def test_indexes_grown_together_equal_indexes_grown_one_by_one(seed):
    """`NgramIndex.extend_many` (a step's rows at once) leaves every index as `extend` would, entry for entry —
    empty and short indexes (fewer tokens than an n-gram), nothing new, a few tokens, an addition past the bulk
    size, a large vocabulary's ids — and `NgramDrafter.grow` starts a new index when a new request took the slot."""
    rng = random.Random(seed)
    lo, hi = rng.choice([(1, 3), (2, 4), (3, 6)])
    vocab = rng.choice([4, 151_936])
    texts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(9)]
    one, many = [NgramIndex(lo, hi) for _ in texts], [NgramIndex(lo, hi) for _ in texts]
    for a, b, t in zip(one, many, texts):
        a.extend(t)
        b.extend(t)
    for _ in range(12):
        news = [[rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 5, 17, 70]))] for _ in texts]
        for a, new in zip(one, news):
            a.extend(new)
        NgramIndex.extend_many(list(zip(many, news)))
        for a, b in zip(one, many):
            assert a.tokens == b.tokens and a._end == b._end
    d = NgramDrafter(vocab_size=vocab, min_n=lo, max_n=hi)
    d.grow([(0, [1, 2, 3, 1, 2]), (1, [5, 6])])
    d.grow([(0, [1, 2, 3, 1, 2, 3, 1]), (1, [7])])  # (slot 1: a new request's shorter history)
    assert d._rows[0].tokens == [1, 2, 3, 1, 2, 3, 1] and d._rows[1].tokens == [7]
    assert d._rows[0]._end == index([1, 2, 3, 1, 2, 3, 1], lo, hi)._end


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="ngram_min"):
        NgramIndex(0, 3)
    with pytest.raises(ConfigError, match="at most ngram_max"):
        NgramIndex(4, 3)


def test_prepare_pads_rows_and_says_whether_any_row_proposed():
    d = NgramDrafter(vocab_size=50, min_n=2, max_n=3)
    tree = Tree.chain(3)
    assert not d.prepare([(0, [1, 2, 3]), (1, [4, 5])], tree, 2, torch.device("cpu"))  # no match: a plain step
    assert d.prepare([(0, [1, 2, 3, 1, 2]), (1, [4, 5, 6])], tree, 2, torch.device("cpu"))
    tokens, q = d.propose(None, None, None, torch.tensor([2, 6]), tree, None, "topk", True)
    assert tokens.tolist() == [[2, 3, 1, 2], [6, 6, 6, 6]]  # row 1: no match, padded with its newest token
    assert q.shape == (2, 4, 50) and torch.equal(q[:, :3].argmax(-1), tokens[:, 1:]) and q[:, 3].sum() == 0
    d.reset_row(0)  # a new request in slot 0: its index starts over
    assert not d.prepare([(0, [9, 8, 7])], tree, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match="chain"):
        d.prepare([(0, [1, 2])], Tree([-1, 0, 0]), 1, torch.device("cpu"))


def test_a_prompt_is_indexed_as_it_prefills(models):
    """Prompt lookup's index of a row grows with each prefill chunk (in the step that runs the chunk's forward,
    after its launches), so the first decoding step finds it built; a new request in the slot starts over."""
    from redwood.engine.engine import Engine

    target, _, tok = models
    drafter = NgramDrafter(320, 2, 4)
    engine = Engine.build(
        target, tok, drafter=drafter, tree=Tree.chain(3), max_num_seqs=1, block_size=8, max_num_batched_tokens=16
    )
    prompt = [3 + (i * 7) % 40 for i in range(40)]  # three chunks of ≤ 16 tokens
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id="a")
    grown = []
    while engine.has_unfinished():
        engine.step()
        index = drafter._rows.get(0)
        grown.append(None if index is None else len(index.tokens))
    assert grown[:3] == [16, 32, 40]  # (each chunk's tokens, before any decoding step)
    engine.add_request(prompt[::-1][:20], SamplingParams(max_new_tokens=2, ignore_eos=True), request_id="b")
    engine.step()
    assert drafter._rows[0].tokens == prompt[::-1][:16]


def test_greedy_ngram_speculation_equals_ar_under_continuous_batching(models):
    """Ragged repetitive prompts arriving at different steps, 3 slots for 6 requests: every request's tokens
    equal its greedy AR output, and drafted tokens were accepted (the test exercises acceptance, not only
    plain steps)."""
    target, _, tok = models
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in prompts]
    arrivals = [0, 0, 1, 3, 5, 9]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=arrivals, max_num_seqs=3, block_size=8)
    for gamma in (1, 3):
        drafter = NgramDrafter(target.config.vocab_size, 1, 3)
        _, spec, _ = run_engine(
            target,
            tok,
            prompts,
            params,
            drafter=drafter,
            tree=Tree.chain(gamma),
            arrivals=arrivals,
            max_num_seqs=3,
            block_size=8,
        )
        assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
        accepted = sum(s.output_sources.count("draft") for s in spec)
        assert accepted > 0 and drafter.proposed > 0


def test_seeded_sampling_with_ngram_drafts_is_reproducible_and_plausible(models):
    """Sampled requests (T = 0.3, seeded) through ngram speculation: the same seeds give the same tokens on a
    second run, and drafts are both accepted and rejected."""
    target, _, tok = models
    prompts = repetitive_prompts(3, seed=9)
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.3, seed=i) for i in range(3)]
    outs = []
    for _ in range(2):
        drafter = NgramDrafter(target.config.vocab_size, 1, 3)
        _, states, _ = run_engine(target, tok, prompts, params, drafter=drafter, tree=Tree.chain(3), block_size=8)
        outs.append([s.output_ids for s in states])
    assert outs[0] == outs[1]
    stats = [s.stats.spec for s in states]
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)


def test_llm_with_a_draftless_config_matches_ar_on_unicode_text(tiny_model_dir):
    """Text prompts with multi-byte characters through LLM(speculative=SpeculativeConfig(draftless="ngram")):
    greedy output equals AR's, text and tokens; the drafter is named in the stats."""
    from redwood import LLM

    prompt = "Größe: ünïcödé ✓ — ünïcödé ✓ — ünïcödé ✓ — "
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = LLM(str(tiny_model_dir)).generate(prompt, p)[0]
    llm = LLM(str(tiny_model_dir), speculative=SpeculativeConfig(draftless="ngram", num_draft_tokens=3, ngram_min=1))
    out = llm.generate(prompt, p)[0]
    assert out.token_ids == ar.token_ids and out.text == ar.text
    assert llm.draft_name == "ngram 1-4" and out.stats["speculative"]["steps"] > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draftless="bogus"), "unknown draftless"),
        (dict(draftless="ngram", self_speculate=True), "exactly one of"),
        (dict(draftless="ngram", draft_kv="streaming", draft_budget=8), "reads no KV cache"),
        (dict(draftless="ngram", draft_weights="int8"), "has no weights"),
        (dict(draftless="ngram", tree="generic-16"), "proposes a chain"),
        (dict(draftless="ngram", ngram_min=3, ngram_max=2), "at most ngram_max"),
        (dict(draftless="ngram", ngram_min=0), "ngram_min must be"),
    ],
)
def test_bad_draftless_configs_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("seed", range(6))
def test_tokens_appended_before_they_are_registered_propose_the_same(seed):
    """An index may append a step's tokens and register them later (`NgramDrafter.lazy`: on a GPU the registering
    runs while the device works): `propose` scans the unregistered tail, newest first, so at every point its
    answers are the plain definition's — a tail of a few tokens, of none, and one longer than `_TAIL` (registered
    first); registered at last, the dictionary equals an index extended token by token."""
    rng = random.Random(seed)
    lo, hi = rng.choice([(1, 3), (2, 4), (3, 6)])
    tokens = [rng.randrange(4) if rng.random() < 0.7 else rng.randrange(151_936) for _ in range(500)]
    ix, pos = NgramIndex(lo, hi), 0
    while pos < len(tokens):
        step = rng.choice([1, 2, 5, 9, 70])
        ix.append(tokens[pos : pos + step])
        pos = min(pos + step, len(tokens))
        k = rng.choice([1, 4, 16])
        assert ix.propose(k) == _reference_proposal(tokens[:pos], k, lo, hi), pos
        assert len(ix.tokens) - ix.indexed <= max(_TAIL, step)  # (a long tail was registered by the proposal)
        if rng.random() < 0.3:
            ix.register()
            assert ix.indexed == pos
    ix.register()
    assert ix._end == index(tokens, lo, hi)._end


def test_a_match_only_in_the_unregistered_tail_is_found_and_wins_over_an_older_one():
    ix = index([1, 2, 9, 5, 5])  # (1, 2) registered, continued by 9
    ix.append([1, 2, 7, 1, 2])  # a newer (1, 2), continued by 7, not registered yet
    assert ix.indexed == 5 and ix.propose(2) == [7, 1]
    ix.register()
    assert ix.propose(2) == [7, 1]


@pytest.mark.parametrize("seed", range(3))
def test_indexes_registered_together_equal_indexes_registered_one_by_one(seed):
    rng = random.Random(seed)
    texts = [[rng.randrange(5) for _ in range(rng.randrange(0, 30))] for _ in range(7)]
    one, many = [index(t) for t in texts], [index(t) for t in texts]
    for _ in range(8):
        news = [[rng.randrange(5) for _ in range(rng.choice([0, 1, 3, 8, 70]))] for _ in texts]
        for a, b, new in zip(one, many, news):
            a.extend(new)
            b.append(new)
        NgramIndex.register_many(many)
        for a, b in zip(one, many):
            assert a.tokens == b.tokens and a._end == b._end and b.indexed == len(b.tokens)


def test_a_lazy_drafter_proposes_as_an_eager_one_and_registers_when_asked():
    rng = random.Random(5)
    texts = {slot: [rng.randrange(6) for _ in range(40)] for slot in range(3)}
    eager, lazy = NgramDrafter(vocab_size=6), NgramDrafter(vocab_size=6)
    lazy.lazy = True
    for slot, t in texts.items():
        for d in (eager, lazy):
            d.index_prefix(slot, t, len(t))
    assert all(lazy._rows[s].indexed == 40 for s in texts)  # (a prompt is registered at once)
    tree = Tree.chain(4)
    for _ in range(6):
        for t in texts.values():
            t += [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        rows = list(texts.items())
        for d in (eager, lazy):
            d.grow(rows)
        assert [eager.shadow_propose(s, t, 6) for s, t in rows] == [lazy.shadow_propose(s, t, 6) for s, t in rows]
        eager.prepare(rows, tree, 3, torch.device("cpu"))
        lazy.prepare(rows, tree, 3, torch.device("cpu"))
        assert torch.equal(eager._buffer, lazy._buffer)
        assert all(lazy._rows[s].indexed < len(t) for s, t in rows)  # (appended, not registered)
        lazy.register_pending([0, 1, 2, 7])  # (a slot without an index: nothing)
        assert all(lazy._rows[s]._end == eager._rows[s]._end for s in texts)
