"""Tree speculation through the engine (Sequoia): lossless against autoregressive decoding.

Greedy: every tree shape, drafter and draft KV policy emits exactly the greedy autoregressive tokens,
and after the run both caches hold exactly the committed tokens' KV (which checks the compaction of the
accepted path into place). Sampled: `sequoia`, `specinfer` and `topk` on a branching tree emit tokens
with the target's exact autoregressive distribution (χ² on a vocab-8 model), reproducibly per seed
and independently of the rest of the batch.

The models are those of tests/engine/test_speculative.py (a target with clear greedy margins and a
noisy copy of it as the standalone draft) and of tests/sample/test_chain_verify.py (the vocab-8 pair).
"""

from __future__ import annotations

import pytest
import torch

import redwood.engine.decode as spec_loop
from redwood import LLM, SamplingParams
from redwood.engine.engine import Engine
from redwood.errors import ConfigError
from redwood.sample.sampler import probabilities
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.trees import Tree, resolve_tree
from redwood.tuning.tree_search import optimal_tree
from tests.engine.test_speculative import (  # noqa: F401  (model_dirs … ar_outputs are fixtures)
    BATCHES,
    NEW_TOKENS,
    _prompts,
    ar_outputs,
    assert_draft_cache_consistent,
    assert_target_cache_is_autoregressive,
    draft_llm,
    make_drafter,
    model_dirs,
    run_ar,
    run_speculative,
    target_llm,
)
from tests.sample.test_chain_verify import (  # noqa: F401  (tiny_vocab_pair is a fixture)
    PROMPT,
    VOCAB,
    assert_fits,
    chi2_fit,
    exact_pair_distribution,
    tiny_vocab_pair,
)

# A root with 6 children, each with one child (wide and shallow).
WIDE = Tree((-1, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6))

TREES = {
    "chain:3": resolve_tree("chain:3"),
    "chains:3x2": resolve_tree("chains:3x2"),
    "wide6x1": WIDE,
    "dp-12": optimal_tree([0.55, 0.2, 0.1, 0.05], budget=12, max_depth=5)[0],
    "generic-16": resolve_tree("generic-16"),
}
# (drafter kind, draft KV policy): the small standalone draft over its full / compressed cache, and the
# target drafting for itself through a compressed view of its own cache.
DRAFTERS = [
    ("standalone", "full"),
    ("standalone", "streaming"),
    ("standalone", "snapkv"),
    ("self", "streaming"),
    ("self", "snapkv"),
]


def test_tree_shapes_are_what_the_names_say():
    assert TREES["chain:3"].is_chain and TREES["chain:3"].size == 4
    assert TREES["chains:3x2"].num_children[0] == 3 and TREES["chains:3x2"].size == 7
    assert TREES["chains:3x2"].num_children[1:] == (1, 1, 1, 0, 0, 0)
    assert WIDE.num_children[0] == 6 and WIDE.max_depth == 3
    dp = TREES["dp-12"]
    assert dp.size == 12 and not dp.is_chain and dp.meta["budget"] == 12
    assert TREES["generic-16"].size == 16
    for name, tree in TREES.items():
        assert name == "chain:3" or max(tree.num_children) >= 2


class PathRecorder:
    """Wraps the engine's `verify_tree_paths` to record the accepted paths' child ranks, per step per row —
    only rows still generating when `requests` is set (a finished row is verified but commits nothing)."""

    def __init__(self):
        self.paths: list[list[int]] = []  # child rank of each accepted node below the root
        self.calls = 0
        self.requests = None

    def install(self, monkeypatch):
        real = spec_loop.verify_tree_paths

        def wrapper(verifier, parents, *args, **kwargs):
            path, nxt = real(verifier, parents, *args, **kwargs)
            self.calls += 1
            ranks = Tree(tuple(parents)).child_rank
            accepted = [[v for v in row if v >= 0] for row in path.tolist()]
            self.paths += [
                [ranks[v] for v in nodes]
                for b, nodes in enumerate(accepted)
                if self.requests is None
                or (b < len(self.requests) and self.requests[b].output_ids and not self.requests[b].finished)
            ]
            return path, nxt

        monkeypatch.setattr(spec_loop, "verify_tree_paths", wrapper)
        return self

    @property
    def beyond_first_child(self) -> int:
        """Accepted paths that go through a child other than its parent's first (rank ≥ 1)."""
        return sum(1 for ranks in self.paths if any(r > 0 for r in ranks))


def run_tree(llm, drafter, prompts, params, tree, verifier="auto", configure=None):
    """`run_speculative` over a tree, with the accepted paths recorded. (run_speculative undoes the
    MonkeyPatch it is given when the loop ends, so the recorder's patch rides on a private one.)"""
    mp = pytest.MonkeyPatch()
    recorder = PathRecorder().install(mp)

    def configure_and_keep(requests):
        recorder.requests = requests
        if configure is not None:
            configure(requests)

    try:
        requests, cache = run_speculative(llm, drafter, prompts, params, tree, mp, verifier, configure_and_keep)
    finally:
        mp.undo()
    return requests, cache, recorder


# ------------------------------------------------------------------------------------------- greedy == AR


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("kind,policy_name", DRAFTERS)
def test_greedy_tree_speculation_equals_autoregressive(
    kind, policy_name, batch, tree_name, target_llm, draft_llm, ar_outputs
):
    tree = TREES[tree_name]
    prompts = BATCHES[batch]
    drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests, cache, rec = run_tree(target_llm, drafter, prompts, params, tree)
    for b, r in enumerate(requests):
        assert r.output_ids == ar_outputs[batch][b], f"row {b} (prompt of {len(r.prompt_ids)} tokens)"
        assert r.finish_reason == "length"
        s = r.stats.to_dict()["speculative"]
        assert s["gamma"] == tree.max_depth - 1 and s["drafted_per_step"] == tree.size - 1
        # (every step drafts the whole tree but the tail ones, cut to the levels the row can still emit)
        assert s["steps"] <= s["drafted"] <= (tree.size - 1) * s["steps"]
        assert 0 < s["accepted"] <= s["steps"] * (tree.max_depth - 1)
        # (emitted tokens only: the last step of a row may end inside its drafts — a batch's step is cut
        # to its longest row's need — counting one bonus too many; or be an AR step, not counted)
        assert NEW_TOKENS - 2 <= s["steps"] + s["accepted"] <= NEW_TOKENS
        assert len(s["acceptance_by_position"]) == tree.max_depth - 1
    # (one tree walk per decoding step; rows start decoding at different steps)
    assert (rec.calls == 0) if tree.is_chain else (rec.calls >= max(r.stats.spec.steps for r in requests))
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
    if kind == "standalone":
        assert_draft_cache_consistent(drafter, cache, requests, policy_name)
    if batch == "ragged3" and not tree.is_chain:
        # The tree is really used: some accepted path goes through a second (or later) child.
        assert rec.beyond_first_child > 0, rec.paths


def test_trees_accept_beyond_the_first_child_and_beat_the_chain(target_llm, draft_llm, ar_outputs):
    """The branching is what pays: across drafters, paths through non-first children are accepted, and a
    16-node tree yields more tokens per step than a chain of depth 3."""
    prompts = BATCHES["ragged3"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for kind, policy_name in (("standalone", "full"), ("self", "streaming")):
        tps = {}
        for name in ("chain:3", "generic-16"):
            drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
            requests, _, rec = run_tree(target_llm, drafter, prompts, params, TREES[name])
            assert [r.output_ids for r in requests] == ar_outputs["ragged3"]
            s = [r.stats.to_dict()["speculative"] for r in requests]
            tps[name] = sum(x["mean_accepted_length"] for x in s) / len(s)
            if name != "chain:3":
                assert rec.beyond_first_child > 0
        assert tps["generic-16"] > tps["chain:3"], (kind, policy_name, tps)


FINISH_PROMPTS = _prompts([90, 40, 65], seed=2)


@pytest.mark.parametrize("kind,policy_name", [("standalone", "full"), ("self", "snapkv")])
def test_rows_finish_independently_inside_an_accepted_path(kind, policy_name, target_llm, draft_llm):
    """Per-row max_new_tokens and an EOS that ends row 0 early: a row may stop in the middle of an
    accepted path; the others go on; every row equals its AR output and the cache holds exactly it."""
    free = run_ar(target_llm, FINISH_PROMPTS[:1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0].output_ids
    eos_tok = free[7]

    def configure(requests):
        requests[0].eos_ids = frozenset({eos_tok})
        requests[1].eos_ids = requests[2].eos_ids = frozenset()

    params = [SamplingParams(max_new_tokens=n) for n in (30, 13, 22)]
    ar = run_ar(target_llm, FINISH_PROMPTS, params, configure)
    for tree in (TREES["generic-16"], WIDE):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache, _ = run_tree(target_llm, drafter, FINISH_PROMPTS, params, tree, configure=configure)
        assert [r.output_ids for r in requests] == [r.output_ids for r in ar]
        assert [r.finish_reason for r in requests] == ["stop", "length", "length"]
        assert [len(r.output_ids) for r in requests[1:]] == [13, 22]
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
        if kind == "standalone":
            assert_draft_cache_consistent(drafter, cache, requests, policy_name)


@pytest.mark.parametrize("verifier", ["greedy", "sequoia", "specinfer", "topk"])
def test_every_verifier_at_temperature_zero_equals_autoregressive(verifier, target_llm, draft_llm, ar_outputs):
    """At temperature 0 every tree verifier reduces to greedy decoding (the target's p is one-hot)."""
    drafter = make_drafter("standalone", "full", target_llm, draft_llm)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests, cache, rec = run_tree(target_llm, drafter, BATCHES["ragged3"], params, TREES["dp-12"], verifier)
    assert [r.output_ids for r in requests] == ar_outputs["ragged3"]
    assert rec.calls > 0
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
    assert_draft_cache_consistent(drafter, cache, requests, "full")


def test_llm_api_with_tree_spec(model_dirs, ar_outputs, tmp_path):
    """SpeculativeConfig(tree=...) through LLM: a shipped name, chains:KxL and a JSON file."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    path = TREES["dp-12"].save(tmp_path / "dp.json")
    for spec in (
        SpeculativeConfig(self_speculate=True, draft_kv="streaming", draft_budget=16, sinks=4, tree="generic-16"),
        SpeculativeConfig(draft_model=str(model_dirs / "draft"), tree="chains:3x2"),
        SpeculativeConfig(
            draft_model=str(model_dirs / "draft"), draft_kv="snapkv", draft_budget=16, window=4, tree=str(path)
        ),
    ):
        llm = LLM(str(model_dirs / "target"), speculative=spec)
        tree = spec.make_tree()
        outs = llm.generate(BATCHES["ragged3"], params)
        assert [o.token_ids for o in outs] == ar_outputs["ragged3"]
        for o in outs:
            s = o.stats["speculative"]
            assert s["gamma"] == tree.max_depth - 1 and s["drafted_per_step"] == tree.size - 1
            assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / s["steps"], abs=1e-4)


# ------------------------------------------------------------------------------------------- sampled runs

SAMPLED_TREE = Tree((-1, 0, 0, 0, 1, 1))  # the root with 3 children, the first of which has 2


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer", "topk"])
@pytest.mark.parametrize("kind,policy_name", [("standalone", "full"), ("self", "streaming")])
def test_sampling_reproducible_and_batch_independent(kind, policy_name, verifier, target_llm, draft_llm):
    prompts = BATCHES["ragged3"]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=200 + i, max_new_tokens=20, ignore_eos=True)
        for i in range(len(prompts))
    ]
    tree = TREES["generic-16"]
    seen = []

    def run(rows, prms):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache, rec = run_tree(target_llm, drafter, [prompts[i] for i in rows], prms, tree, verifier)
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
        if kind == "standalone":
            assert_draft_cache_consistent(drafter, cache, requests, policy_name)
        seen.append(rec.beyond_first_child)
        return [r.output_ids for r in requests]

    a = run([0, 1, 2], params)
    assert all(len(x) == 20 for x in a)
    assert run([0, 1, 2], params) == a
    assert run([1], [params[1]]) == [a[1]]
    assert run([2, 0], [params[2], params[0]]) == [a[2], a[0]]
    other = run(
        [0, 1, 2],
        [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_new_tokens=20, ignore_eos=True) for i in range(3)],
    )
    assert other != a
    assert sum(seen) > 0  # compaction of non-first children ran under sampling too


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer", "topk"])
def test_mixed_greedy_and_sampled_rows_on_a_tree(verifier, target_llm, draft_llm, ar_outputs):
    """One greedy row among sampled ones (so a sampling verifier runs for all): with one-hot p and q the
    walk still picks the target's argmax, and the sampled rows equal their runs without the greedy row."""
    prompts = BATCHES["ragged3"]
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=21, max_new_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=22, max_new_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] + sampled
    drafter = make_drafter("standalone", "full", target_llm, draft_llm)
    requests, cache, _ = run_tree(target_llm, drafter, prompts, params, TREES["dp-12"], verifier)
    assert requests[0].output_ids == ar_outputs["ragged3"][0]
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
    assert_draft_cache_consistent(drafter, cache, requests, "full")
    drafter = make_drafter("standalone", "full", target_llm, draft_llm)
    alone, _, _ = run_tree(target_llm, drafter, prompts[1:], sampled, TREES["dp-12"], verifier)
    assert [r.output_ids for r in requests[1:]] == [r.output_ids for r in alone]


def test_sampling_verifier_on_a_tree_is_sequoia(target_llm, draft_llm):
    """verifier='sampling' (and 'auto' with sampled requests) on a tree run Sequoia: the same tokens as
    verifier='sequoia' for the same seeds; on a chain 'auto' is match under position noise (the default: a
    seed's tokens whatever the plan), plain rejection sampling under counter noise."""
    assert spec_loop.resolve_verifier("sampling", SAMPLED_TREE, all_greedy=False) == "sequoia"
    assert spec_loop.resolve_verifier("auto", SAMPLED_TREE, all_greedy=False) == "sequoia"
    assert spec_loop.resolve_verifier("auto", SAMPLED_TREE, all_greedy=True) == "greedy"
    assert spec_loop.resolve_verifier("auto", Tree.chain(3), all_greedy=False) == "match"
    assert spec_loop.resolve_verifier("auto", Tree.chain(3), all_greedy=False, noise="counter") == "sampling"
    prompts = BATCHES["ragged3"]
    params = [
        SamplingParams(temperature=1.0, seed=300 + i, max_new_tokens=15, ignore_eos=True) for i in range(len(prompts))
    ]
    outs = {}
    for verifier in ("sampling", "auto", "sequoia", "specinfer"):
        drafter = make_drafter("standalone", "full", target_llm, draft_llm)
        requests, _, rec = run_tree(target_llm, drafter, prompts, params, TREES["generic-16"], verifier)
        outs[verifier] = [r.output_ids for r in requests]
        assert rec.calls > 0
    assert outs["sampling"] == outs["sequoia"] == outs["auto"]
    assert outs["specinfer"] != outs["sequoia"]  # a different walk (and child rule) is really selected


def test_greedy_verifier_with_sampled_request_is_an_error_on_a_tree(model_dirs):
    spec = SpeculativeConfig(draft_model=str(model_dirs / "draft"), tree="generic-16", verifier="greedy")
    llm = LLM(str(model_dirs / "target"), speculative=spec)
    with pytest.raises(ConfigError, match="greedy verifier"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.7, seed=1, max_new_tokens=4))
    with pytest.raises(ConfigError, match="greedy verifier"):
        llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_new_tokens=4), SamplingParams(temperature=0.5)])
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids) == 4


# ------------------------------------------------------------------------------------------- χ² end to end


@torch.inference_mode()
def exact_triple_distribution(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V, V]: the autoregressive probability of each (first, second, third) generated token triple."""
    V = VOCAB
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V², 2], row t1 * V + t2
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], dim=1)
    cache = model.new_cache(V * V, ids.shape[1])
    logits = model(ids, torch.arange(ids.shape[1])[None].expand(V * V, -1), cache)  # [V², len+2, V]

    def probs(x):
        n = x.shape[0]
        return probabilities(
            x, torch.full((n,), params.temperature), torch.full((n,), params.top_k), torch.full((n,), params.top_p)
        )

    p1 = probs(logits[:1, -3])[0]  # after the prompt
    p2 = probs(logits[::V, -2])  # [V, V]: after prompt + [t1]
    p3 = probs(logits[:, -1]).view(V, V, V)  # after prompt + [t1, t2]
    return p1[:, None, None] * p2[:, :, None] * p3


CHI2_ROWS = 4000
CHI2_CASES = [
    ("sequoia", 1.0, 1.0),
    ("specinfer", 1.0, 1.0),
    ("topk", 1.0, 1.0),
    ("sequoia", 0.7, 0.9),
    ("specinfer", 0.7, 0.9),
    ("topk", 0.7, 0.9),
]


@pytest.mark.parametrize("verifier,temperature,top_p", CHI2_CASES)
def test_tree_verifiers_end_to_end_follow_target(verifier, temperature, top_p, tiny_vocab_pair, tmp_path):
    """LLM(..., tree, verifier) on the vocab-8 pair: over 4,000 seeded rows (one generate call) the first
    two generated tokens follow the target's exact autoregressive joint (64 cells), and so do the first
    three (512 cells, small ones pooled). The first token comes from the prefill; the second is the root's
    accepted child or the correction; the third the accepted grandchild, the correction/bonus of the same
    step, or the next step's."""
    target, draft = tiny_vocab_pair
    tree_file = SAMPLED_TREE.save(tmp_path / "tree.json")
    llm = LLM(
        str(target), speculative=SpeculativeConfig(draft_model=str(draft), tree=str(tree_file), verifier=verifier)
    )
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_new_tokens=3, ignore_eos=True)
        for s in range(CHI2_ROWS)
    ]
    mp = pytest.MonkeyPatch()
    rec = PathRecorder().install(mp)
    try:
        outs = llm.generate([PROMPT] * CHI2_ROWS, params)
    finally:
        mp.undo()
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (CHI2_ROWS, 3)
    # Not a trivial pass: the draft differs from the target, and both depth 2 and non-first children of
    # the root are accepted.
    stats = [o.stats["speculative"] for o in outs]
    acceptance = sum(s["accepted"] for s in stats) / sum(s["steps"] for s in stats)
    assert 0.1 < acceptance < 1.5  # accepted draft tokens per step (at most 2)
    assert any(len(p) == 2 for p in rec.paths) and rec.beyond_first_child > 0
    label = f"{verifier} T={temperature} top_p={top_p}"
    exact2 = exact_pair_distribution(llm.model, PROMPT, params[0])
    assert_fits(toks[:, 0] * VOCAB + toks[:, 1], exact2, f"{label}: first two tokens")
    exact3 = exact_triple_distribution(llm.model, PROMPT, params[0])
    torch.testing.assert_close(exact3.sum(-1), exact2)
    assert_fits((toks[:, 0] * VOCAB + toks[:, 1]) * VOCAB + toks[:, 2], exact3, f"{label}: first three tokens")


def test_end_to_end_chi2_detects_a_lossy_tree_verifier(tiny_vocab_pair, tmp_path):
    """Control: Sequoia's walk fed q = 0 (accept any child the target can emit) follows the draft, and the
    same end-to-end test rejects it — the fits above have power."""
    target, draft = tiny_vocab_pair
    llm = LLM(
        str(target),
        speculative=SpeculativeConfig(
            draft_model=str(draft), tree=str(SAMPLED_TREE.save(tmp_path / "tree.json")), verifier="sequoia"
        ),
    )
    real = spec_loop.verify_tree_paths

    def lossy(verifier, parents, tokens, p, q, rand, *rest):
        return real(verifier, parents, tokens, p, torch.zeros_like(q), rand, *rest)

    rows = 1000
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=2, ignore_eos=True) for s in range(rows)]
    mp = pytest.MonkeyPatch()
    mp.setattr(spec_loop, "verify_tree_paths", lossy)
    try:
        toks = torch.tensor([o.token_ids for o in llm.generate([PROMPT] * rows, params)])
    finally:
        mp.undo()
    stat, limit, _ = chi2_fit(toks[:, 0] * VOCAB + toks[:, 1], exact_pair_distribution(llm.model, PROMPT, params[0]))
    assert stat > 3 * limit


def test_tree_without_drafts_decodes_like_the_target(target_llm, draft_llm, ar_outputs, tiny_vocab_pair):
    """chain:0 (a lone root; resolve_tree accepts it, a SpeculativeConfig does not) is a plain decoding
    step each time through the engine's machinery: greedy equals AR, and sampled (the verifier then
    draws straight from p) follows the target's distribution."""
    lone = resolve_tree("chain:0")
    assert lone.size == 1
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    for kind, policy_name in (("standalone", "full"), ("self", "streaming")):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache, _ = run_tree(target_llm, drafter, BATCHES["ragged3"], params, lone)
        assert [r.output_ids for r in requests] == [x[:10] for x in ar_outputs["ragged3"]]
        assert all(r.stats.spec.steps == 0 for r in requests)  # (steps without drafts: no speculation steps)
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
    target, draft = tiny_vocab_pair
    with pytest.raises(ConfigError, match="no draft tokens"):
        SpeculativeConfig(draft_model=str(draft), tree="chain:0")
    llm = LLM(str(target), speculative=SpeculativeConfig(draft_model=str(draft), num_draft_tokens=1))
    # (the models of a one-draft LLM, driven by an engine over the lone root: what tools may build)
    llm.engine = Engine.build(llm.model, llm.tokenizer, drafter=llm.drafter, tree=lone)
    rows = 2000
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=2, ignore_eos=True) for s in range(rows)]
    toks = torch.tensor([o.token_ids for o in llm.generate([PROMPT] * rows, params)])
    assert_fits(
        toks[:, 0] * VOCAB + toks[:, 1],
        exact_pair_distribution(llm.model, PROMPT, params[0]),
        "chain:0: first two tokens",
    )


def test_a_tree_is_cut_to_the_levels_the_request_can_still_emit(target_llm, draft_llm, ar_outputs):
    """generic-16 (6 levels) with 3 new tokens: after the prefill's token one step can emit 2, so it
    drafts only the tree's first level below the root (a breadth-first prefix of the tree)."""
    tree = TREES["generic-16"]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    drafter = make_drafter("self", "full", target_llm, draft_llm)  # (the target itself: all accepted)
    requests, cache, _ = run_tree(target_llm, drafter, BATCHES["single"], params, tree)
    assert requests[0].output_ids == ar_outputs["single"][0][:3]
    s = requests[0].stats.to_dict()["speculative"]
    assert (s["steps"], s["drafted"], s["accepted"]) == (1, tree.level_widths[1], 1)
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
