"""The suffix drafter (redwood.speculation.suffix, .suffix_index): the index's matching and ranking on edge cases
(against a from-scratch count), the shared index's opt-in and bound, the tree fill and its padding, the verifier
rules for deterministic children, greedy speculation == greedy AR through the Engine (a repetitive workload,
so proposals are accepted; the KV cache as AR's), seeded sampling under topk, Unicode text through a real
tokenizer, and the configuration / CLI errors. (Exactness of topk over the drafter's children:
tests/sample/test_verifiers_exact.py, `test_topk_walk_is_exact_over_suffix_children`; through the engine:
tests/bench/test_lossless.py, method suffix-topk.)"""

from __future__ import annotations

import random

import pytest
import torch

from redwood import SamplingParams
from redwood.engine.decode import resolve_verifier
from redwood.engine.loaded import LoadedModels
from redwood.errors import ConfigError
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.suffix import DEFAULT_TREE, SuffixDrafter, fill_tree
from redwood.speculation.suffix_index import RANKED, SharedIndex, SuffixIndex, ranked_children
from redwood.speculation.trees import Tree
from tests.engine.driver import repetitive_prompts, run_engine
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture
from tests.engine.test_speculative import assert_target_cache_is_autoregressive

CPU = torch.device("cpu")


def index(tokens, lo=2, hi=4) -> SuffixIndex:
    ix = SuffixIndex(lo, hi)
    ix.extend(tokens)
    return ix


def kids(ix: SuffixIndex, k: int = 3, context=None, shared=None) -> list[int]:
    tail = tuple(ix.tokens if context is None else context)[-ix.table.max_n :]
    sources = (ix,) if shared is None else (ix, shared)
    return ranked_children(sources, tail, k, ix.table.min_n, ix.table.max_n)


def reference(tokens, context, k, lo, hi) -> list[int]:
    """ranked_children from scratch: for each suffix of `context` (longest first), every continuation in
    `tokens` with its count and latest position, sorted (count, latest) descending, capped at RANKED."""
    out: list[int] = []
    for n in range(min(hi, len(context)), lo - 1, -1):
        gram = tuple(context[len(context) - n :])
        stats: dict[int, list[int]] = {}
        for i in range(n, len(tokens)):
            if tuple(tokens[i - n : i]) == gram:
                s = stats.setdefault(tokens[i], [0, 0])
                s[0], s[1] = s[0] + 1, i
        for t in sorted(stats, key=lambda t: tuple(stats[t]), reverse=True)[:RANKED]:
            if t not in out:
                out.append(t)
    return out[:k]


# ------------------------------------------------------------------------------------------ the index
def test_no_match_and_a_history_shorter_than_n_give_nothing():
    assert kids(index([1, 2, 3, 4, 5])) == []
    assert kids(index([7], lo=2)) == [] and kids(index([7, 7], lo=3, hi=4)) == []
    assert kids(index([])) == []


def test_a_match_at_the_very_end():
    # (7, 7) was followed by 7 once, ending one token before the end: the continuation is the suffix itself
    assert kids(index([3, 7, 7, 7])) == [7]
    assert kids(index([1, 2, 1, 2]), k=1) == [1]


def test_counts_rank_children_and_ties_go_to_the_most_recent():
    # bigrams only (a longer suffix would match one occurrence)
    assert kids(index([5, 6, 1, 5, 6, 2, 5, 6, 1, 5, 6], 2, 2)) == [1, 2]  # 1 twice, 2 once
    assert kids(index([5, 6, 1, 5, 6, 2, 5, 6], 2, 2)) == [2, 1]  # once each: the later first
    assert kids(index([5, 6, 1, 5, 6, 2, 5, 6], 2, 2), k=1) == [2]
    assert kids(index([5, 6, 1, 5, 6, 2, 5, 6, 1, 5, 6, 2, 9, 5, 6], 2, 2)) == [2, 1]  # 2 each: the later


def test_the_longest_suffix_ranks_first_and_shorter_ones_fill_the_rest():
    # (2, 3, 1, 2) was followed by 4 once; (1, 2) by 3 twice and 4 once
    assert kids(index([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])) == [4, 3]
    assert kids(index([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], lo=2, hi=2)) == [3, 4]


def test_the_index_grows_incrementally_as_a_count_from_scratch_ranks():
    """Random tokens over a small vocabulary (repeated n-grams with more than RANKED continuations): after
    every token, the ranked children of the history and of a hypothetical path equal a from-scratch count."""
    rng = random.Random(0)
    tokens = [rng.randrange(12) for _ in range(400)]
    ix = SuffixIndex(1, 3)
    for i, t in enumerate(tokens):
        ix.extend([t])
        for context in (tokens[: i + 1], tokens[: i + 1] + [rng.randrange(12)]):
            assert kids(ix, RANKED + 2, context) == reference(tokens[: i + 1], context, RANKED + 2, 1, 3), i


def test_shared_index_is_opt_in_and_fills_after_the_rows_own():
    """A finished request's tokens reach another request only through the shared index, and rank after the
    row's own continuations of the same suffix."""
    for shared in (False, True):
        d = SuffixDrafter(50, 2, 3, shared=shared)
        tree = Tree.from_branching([2])
        assert not d.prepare([(0, [1, 2, 3, 4, 1, 2, 9])], tree, 1, CPU)  # ((2, 9) never seen before)
        d.reset_row(0)  # the request leaves: its tokens go to the shared index (when there is one)
        matched = d.prepare([(0, [7, 1, 2, 5, 1, 2])], tree, 1, CPU)
        tokens, _ = d.propose(None, None, None, torch.tensor([2]), tree, None, "topk", False)
        # own: (1, 2) → 5; shared: (1, 2) → 3 and 9 (the newer first), one more child to fill
        assert matched and tokens.tolist() == [[2, 5, 9 if shared else 2]]


def test_shared_index_is_bounded_oldest_out():
    s = SharedIndex(1, 2, capacity=20)
    s.add([1, 2, 3, 4, 5, 6])  # young: 6 tokens
    s.add([1, 2, 8, 9])  # young: 10 (= capacity / 2)
    assert s.size == 10 and s.ranked((1, 2)) == [8, 3]
    s.add([1, 2, 7])  # the young generation is full: it becomes the old one
    assert s.size == 13 and s.ranked((1, 2)) == [7, 8, 3]
    s.add([4, 4, 4, 4, 4, 4, 4, 4])  # young fills again: the first two requests go
    assert s.size == 11 and s.ranked((1, 2)) == [7] and s.ranked((2,)) == [7]
    s.add(list(range(100, 150)))  # longer than capacity / 2: its last 10 tokens only
    assert s.size <= 20 and s.ranked((100,)) == [] and s.ranked((148,)) == [149]
    with pytest.raises(ConfigError, match="capacity"):
        SharedIndex(1, 2, capacity=1)


def test_tree_fill_ranks_children_and_pads_with_the_parents_token():
    ix = index([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], lo=1, hi=3)
    tree = Tree.from_branching([3, 2, 1])  # root → 1, 2, 3; node 1 → 4, 5; node 2 → 6
    d = SuffixDrafter(10, 1, 3)
    lookup = lambda tail, k: ranked_children((ix,), tail, k, 1, 3)  # noqa: E731
    tokens, found = fill_tree(tree, ix.tokens, lookup, 3)
    # root 2: (3, 1, 2) → 4; (1, 2) adds 3; (2,) nothing new → the third child is padding (2, the root)
    assert tokens[:4] == [2, 4, 3, 2] and found[:4] == [True, True, True, False]
    # node 1 (…, 2, 4): → 1, then padding 4; node 2 (…, 2, 3): → 1
    assert tokens[4:] == [1, 4, 1] and found[4:] == [True, False, True]
    assert d.describe() == "suffix 1-3"


def test_prepare_says_whether_any_row_matched_and_fills_cut_trees():
    d = SuffixDrafter(vocab_size=50, min_n=2, max_n=3)
    assert not d.prepare([(0, [1, 2, 3]), (1, [4, 5])], DEFAULT_TREE, 2, CPU)  # no match: a plain step
    assert d.prepare([(0, [1, 2, 3, 1, 2]), (1, [4, 5, 6])], DEFAULT_TREE, 2, CPU)
    tokens, q = d.propose(None, None, None, torch.tensor([2, 6]), DEFAULT_TREE, None, "topk", False)
    assert q is None and tokens.shape == (2, DEFAULT_TREE.size)
    assert tokens[0, :2].tolist() == [2, 3] and tokens[1].tolist() == [6] * DEFAULT_TREE.size  # row 1: padding
    assert d.proposed == 1 and d.unmatched == 3 and d.filled > 0
    cut = DEFAULT_TREE.first_levels(2)  # (a greedy step near the end: the engine's tree cut)
    assert d.prepare([(0, [1, 2, 3, 1, 2, 3])], cut, 1, CPU)
    tokens, _ = d.propose(None, None, None, torch.tensor([3]), cut, None, "topk", False)
    assert tokens.shape == (1, cut.size) and tokens[0, :2].tolist() == [3, 1]
    chain = Tree.chain(3)  # a chain with rejection sampling: one-hot q
    assert d.prepare([(0, [1, 2, 3, 1, 2, 3])], chain, 1, CPU)
    tokens, q = d.propose(None, None, None, torch.tensor([3]), chain, None, "swor", True)
    assert tokens.tolist() == [[3, 1, 2, 3]] and torch.equal(q[0, :3].argmax(-1), tokens[0, 1:])
    with pytest.raises(ConfigError, match="greedy / topk"):
        d.propose(None, None, None, torch.tensor([3]), DEFAULT_TREE, None, "swor", True)


# ------------------------------------------------------------------------------------------ verifiers
def test_auto_verifies_deterministic_trees_with_match_or_topk_and_refuses_the_q_walks():
    tree, chain = DEFAULT_TREE, Tree.chain(3)
    assert resolve_verifier("auto", tree, all_greedy=True, deterministic=True) == "greedy"
    assert resolve_verifier("auto", tree, all_greedy=False, deterministic=True) == "match"  # position noise
    assert resolve_verifier("auto", tree, False, "counter", deterministic=True) == "topk"
    assert resolve_verifier("auto", chain, False, "counter", deterministic=True) == "sampling"  # one-hot q
    assert resolve_verifier("auto", tree, all_greedy=False) == "sequoia"  # (a model draft: unchanged)
    for kind in ("sampling", "sequoia", "specinfer"):
        with pytest.raises(ConfigError, match="deterministic"):
            resolve_verifier(kind, tree, all_greedy=False, deterministic=True)
        assert resolve_verifier(kind, chain, all_greedy=False, deterministic=True) in ("sampling", kind)


def test_an_engine_refuses_a_q_walk_over_suffix_children(models):
    target, _, tok = models
    with pytest.raises(ConfigError, match="deterministic"):
        LoadedModels.of(
            target, tok, drafter=SuffixDrafter(target.config.vocab_size), tree=DEFAULT_TREE, verifier="sequoia"
        )


# ------------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("tree, shared", [(DEFAULT_TREE, False), (Tree.from_branching([3, 2, 1, 1, 1]), True)])
def test_greedy_suffix_speculation_equals_ar_under_continuous_batching(models, tree, shared):
    """Ragged repetitive prompts arriving at different steps, 3 slots for 6 requests: every request's tokens
    equal its greedy AR output, its cache holds AR's KV, and drafted tokens were accepted."""
    target, _, tok = models
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in prompts]
    arrivals = [0, 0, 1, 3, 5, 9]
    kw = dict(arrivals=arrivals, max_num_seqs=3, block_size=8)
    _, ar, _ = run_engine(target, tok, prompts, params, **kw)
    drafter = SuffixDrafter(target.config.vocab_size, 1, 3, shared=shared)
    _, spec, snaps = run_engine(target, tok, prompts, params, drafter=drafter, tree=tree, **kw)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert sum(s.output_sources.count("draft") for s in spec) > 0 and drafter.proposed > 0
    assert_target_cache_is_autoregressive(target, snaps, spec)


def test_seeded_sampling_through_suffix_trees_gives_the_ar_tokens(models, monkeypatch):
    """Seeded sampled requests (T = 0.1, beside a T = 0.8 one) through suffix trees with verifier "auto": under
    position noise (the default) that is match, so every request's tokens are its AR tokens, arriving at other
    steps in fewer slots; drafts were both accepted and rejected. Under counter noise "auto" is topk: the same
    seeds give the same tokens on a second run."""
    import redwood.engine.decode as decode
    from tests.engine.driver import RecordingEngine

    kinds = set()
    real = decode._verify
    monkeypatch.setattr(decode, "_verify", lambda kind, *a: kinds.add(kind) or real(kind, *a))
    target, _, tok = models
    prompts = repetitive_prompts(4, seed=9)  # (the tiny random model rarely repeats: T 0.1 keeps it close to greedy)
    params = [
        SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8 if i == 3 else 0.1, seed=i) for i in range(4)
    ]
    _, ar, _ = run_engine(target, tok, prompts, params, block_size=8)
    drafter = SuffixDrafter(target.config.vocab_size, 1, 3)
    kw = dict(drafter=drafter, tree=DEFAULT_TREE, block_size=8)
    _, spec, _ = run_engine(target, tok, prompts, params, arrivals=[0, 1, 1, 4], max_num_seqs=2, **kw)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar] and kinds == {"match"}
    stats = [s.stats.spec for s in spec]
    assert 0 < sum(s.accepted for s in stats) < sum(s.drafted for s in stats)
    kinds.clear()
    outs = []
    for _ in range(2):
        engine = RecordingEngine.build(
            target,
            tok,
            drafter=SuffixDrafter(target.config.vocab_size, 1, 3),
            tree=DEFAULT_TREE,
            sampling_noise="counter",
            block_size=8,
        )
        _, states, _ = run_engine(target, tok, prompts, params, engine=engine)
        outs.append([s.output_ids for s in states])
    assert outs[0] == outs[1] and kinds == {"topk"}


def test_the_auto_policy_plans_suffix_chains(models):
    """`policy="auto"` with the suffix drafter as its draftless one: chains of its best path among its plans, the
    greedy tokens AR's."""
    from tests.engine.driver import RecordingEngine

    target, _, tok = models
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, ar, _ = run_engine(target, tok, prompts, params)
    d = SuffixDrafter(target.config.vocab_size, 1, 3)
    assert d.shadow_propose(9, [1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    assert d.shadow_propose(9, [1, 2, 3, 1, 2, 3, 1, 2, 7], 4) == [] and d.family == "suffix"
    d.reset_row(9)
    engine = RecordingEngine.build(target, tok, auto_drafters=[d], max_num_seqs=3, block_size=8)
    _, spec, _ = run_engine(target, tok, prompts, params, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert any(p.startswith("suffix") for s in spec for p in s.stats.spec.plans)


def test_llm_with_the_suffix_drafter_matches_ar_on_unicode_text(tiny_model_dir):
    """Text with multi-byte characters through a real byte-level BPE tokenizer: the index proposes the
    repetition's next token; LLM(speculative=SpeculativeConfig(draftless="suffix")) output equals AR's."""
    from redwood import LLM

    prompt = "Größe: ünïcödé ✓ — ünïcödé ✓ — ünïcödé ✓ — "
    ar_llm = LLM(str(tiny_model_dir))
    ids = ar_llm.encode(prompt)
    period = ar_llm.encode("ünïcödé ✓ — ")
    assert kids(index(ids, 1, 4), k=1) == [ids[-len(period)]]  # (the period's first token comes next)
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = ar_llm.generate(prompt, p)[0]
    llm = LLM(str(tiny_model_dir), speculative=SpeculativeConfig(draftless="suffix", ngram_min=1))
    out = llm.generate(prompt, p)[0]
    assert out.token_ids == ar.token_ids and out.text == ar.text
    assert llm.draft_name == "suffix 1-4" and out.stats["speculative"]["steps"] > 0


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draftless="suffix", verifier="sequoia"), "deterministic"),
        (dict(draftless="suffix", verifier="sampling", tree="generic-16"), "deterministic"),
        (dict(draftless="suffix", num_draft_tokens=3), "tree='chain:3'"),
        (dict(draftless="ngram", suffix_shared=True), "suffix_shared applies"),
        (dict(draftless="suffix", suffix_shared=1), "True or False"),
        (dict(draftless="suffix", draft_kv="streaming", draft_budget=8), "reads no KV cache"),
        (dict(draftless="suffix", ngram_min=3, ngram_max=2), "at most ngram_max"),
    ],
)
def test_bad_suffix_configs_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig(**kwargs)


def test_suffix_config_trees():
    assert SpeculativeConfig(draftless="suffix").make_tree() == DEFAULT_TREE
    assert SpeculativeConfig(draftless="suffix", tree="chain:3", verifier="sampling").make_tree() == Tree.chain(3)
    assert SpeculativeConfig(draftless="suffix", tree="generic-16", verifier="topk").make_tree().size == 16
