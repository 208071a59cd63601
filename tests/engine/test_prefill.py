"""Prefill: SnapKV observation through a chunked prefill, and exact prefix reuse in a pooled runner.

Tiny random Qwen2-style models on the CPU in float32 (the target's greedy choices have clear margins; the
standalone draft is a noisy copy of it). Small prefill chunks are forced by monkeypatching
`MIN_PREFILL_CHUNK` / `PREFILL_SCORE_BUDGET`, with ragged prompts whose observation windows straddle
chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

import redwood.engine.generate as gen
from redwood import LLM, SamplingParams
from redwood.engine.generate import autoregressive, make_requests, prefill
from redwood.engine.runner import CAPACITY_STEP, RunnerPool
from redwood.engine.speculative import speculative
from redwood.kv.policies import SnapKVPolicy, StreamingPolicy
from redwood.spec.drafters import ModelDrafter, SelfDrafter
from redwood.spec.trees import Tree
from tests.conftest import save_target_and_draft
from tests.kv.test_policies import assert_same_selection

CHUNK = 16
# Windows of 8: [62, 70) and [92, 100) straddle the chunk boundaries 64 and 96, row 4 is shorter than a
# window, and no window touches the chunk [16, 32).
LENGTHS = [70, 45, 100, 40, 5]
NEW_TOKENS = 20


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(LENGTHS)
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """(target, draft) Transformers: a clear-margin target and a noisy copy of it."""
    root = tmp_path_factory.mktemp("prefill-models")
    save_target_and_draft(root, tokenizer, noise=0.01)
    return LLM(str(root / "target")).model, LLM(str(root / "draft")).model


def small_chunks(monkeypatch, chunk: int = CHUNK) -> None:
    monkeypatch.setattr(gen, "MIN_PREFILL_CHUNK", chunk)
    monkeypatch.setattr(gen, "PREFILL_SCORE_BUDGET", 1)  # → chunks of the minimum size


def whole_prompts(monkeypatch) -> None:
    monkeypatch.setattr(gen, "PREFILL_SCORE_BUDGET", 1 << 40)  # → one forward over the whole prompt


class PrefillForwards:
    """Counts a model's prefill forwards (the only ones with `logits_at`): (first position, T, observed)."""

    def __init__(self, monkeypatch, model):
        self.calls: list[tuple[int, int, bool]] = []
        forward = model.forward

        def counted(input_ids, positions, cache, *args, **kwargs):
            if kwargs.get("logits_at") is not None:
                self.calls.append((int(positions[0, 0]), input_ids.shape[1], kwargs.get("observer") is not None))
            return forward(input_ids, positions, cache, *args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)


def generate(model, prompts, params, pool, drafter=None, tree=None) -> list[list[int]]:
    """Output token ids of one generation (autoregressive when no drafter) through `pool`."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    requests = make_requests(prompts, plist, model.config, None)
    if drafter is None:
        loop = autoregressive(model, requests, pool)
    else:
        loop = speculative(model, drafter, requests, tree or Tree.chain(3), "auto", pool)
    for _ in loop:
        pass
    return [r.output_ids for r in requests]


# ------------------------------------------------------------------------------- chunked observation


def expected_forwards(windows: list[tuple[int, int]], T: int, chunk: int = CHUNK) -> list[tuple[int, bool]]:
    """(first position, observed) of each prefill forward under `small_chunks` (a score budget of 1): a
    chunk without window queries in one forward; in the others, each window position in its own observed
    forward and each run of other positions in one unobserved forward."""
    watched = {p for a, b in windows for p in range(a, b)}
    out: list[tuple[int, bool]] = []
    for s in range(0, T, chunk):
        positions = range(s, min(s + chunk, T))
        if not watched.intersection(positions):
            out.append((s, False))
            continue
        for p in positions:
            if p in watched or p == s or p - 1 in watched:
                out.append((p, p in watched))
    return out


class ScoringSnapKV(SnapKVPolicy):
    """SnapKV that keeps each layer's final scores and the chunk starts it observed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.final_scores: dict[int, torch.Tensor] = {}
        self.starts: dict[int, list[int]] = {}

    def observe(self, layer, q, k, mask=None, q_start=0):
        self.starts.setdefault(layer, []).append(q_start)
        super().observe(layer, q, k, mask, q_start)

    def _select(self, layer, votes):
        self.final_scores[layer] = self.scores(votes)
        super()._select(layer, votes)


@torch.inference_mode()
def observed_prefill(model, prompts, window, kernel, pool_kind):
    policy = ScoringSnapKV(window + 12, window=window, kernel=kernel, pool=pool_kind)
    policy.start(torch.tensor([len(p) for p in prompts]), model.config.num_layers)
    cache = model.new_cache(len(prompts), 128)
    logits = prefill(model, cache, prompts, observer=policy.prefill_observer())
    return policy, logits, cache


@pytest.mark.parametrize("window,kernel,pool_kind", [(8, 5, "avg"), (8, 3, "max"), (20, 5, "avg"), (1, 1, "avg")])
def test_chunked_observation_selects_as_one_forward(models, monkeypatch, window, kernel, pool_kind):
    """Observing a prefill in 16-token chunks gives the selection of one forward over the whole prompt;
    only the chunks holding window queries are observed (the others take the fast path), and the
    accumulated votes are freed once selected."""
    model = models[0]
    whole_prompts(monkeypatch)
    one, one_logits, one_cache = observed_prefill(model, PROMPTS, window, kernel, pool_kind)
    assert all(starts == [0] for starts in one.starts.values())
    small_chunks(monkeypatch)
    forwards = PrefillForwards(monkeypatch, model)
    chunked, logits, cache = observed_prefill(model, PROMPTS, window, kernel, pool_kind)

    windows = [(max(n - window, 0), n) for n in LENGTHS]
    expected = expected_forwards(windows, max(LENGTHS))
    assert [(s, obs) for s, _, obs in forwards.calls] == expected
    if window <= 8:
        assert (16, False) in expected  # a whole chunk ran unobserved
    observed = [s for s, obs in expected if obs]
    assert all(chunked.starts[layer] == observed for layer in range(model.config.num_layers))
    assert all(v is None for v in chunked._votes)

    torch.testing.assert_close(logits, one_logits, rtol=1e-4, atol=1e-4)
    assert cache.lengths.tolist() == LENGTHS
    for layer in range(model.config.num_layers):
        got_scores, want_scores = chunked.final_scores[layer], one.final_scores[layer]
        assert torch.equal(got_scores.isinf(), want_scores.isinf())
        finite = want_scores.isfinite()
        torch.testing.assert_close(got_scores[finite], want_scores[finite], rtol=1e-5, atol=1e-6)
        for b in range(len(PROMPTS)):
            for h in range(model.config.num_kv_heads):
                got = chunked.selected[layer][b, h][chunked.selected_valid[layer][b, h]].tolist()
                want = one.selected[layer][b, h][one.selected_valid[layer][b, h]].tolist()
                assert_same_selection(set(got), set(want), want_scores[b, h].tolist(),
                                      f"layer {layer} row {b} head {h}")


@torch.inference_mode()
def test_observation_window_scores_are_bounded_per_row_group(models, monkeypatch):
    """A tiny score budget computes the window attention a row at a time: same votes."""
    import redwood.kv.policies as policies

    model = models[0]
    whole_prompts(monkeypatch)
    one, _, _ = observed_prefill(model, PROMPTS, 8, 5, "avg")
    monkeypatch.setattr(policies, "OBSERVE_SCORE_BUDGET", 1)
    rows, _, _ = observed_prefill(model, PROMPTS, 8, 5, "avg")
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(rows.final_scores[layer], one.final_scores[layer], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tree", ["chain:1", "chain:3", "generic-16"])
def test_snapkv_self_speculation_with_chunked_prefill_equals_autoregressive(models, monkeypatch, tree):
    """Greedy self-speculation with SnapKV observed through 16-token chunks: the target's own output,
    and the same drafts (acceptance) as with the prompt observed in one forward."""
    from redwood.spec.trees import resolve_tree

    model = models[0]
    shape = resolve_tree(tree)
    small_chunks(monkeypatch)
    ar = generate(model, PROMPTS, GREEDY, RunnerPool(use_graphs=False))
    runs = [make_requests(PROMPTS, [GREEDY] * len(PROMPTS), model.config, None) for _ in range(2)]
    for requests, setup in zip(runs, (small_chunks, whole_prompts)):
        setup(monkeypatch)
        drafter = SelfDrafter(model, SnapKVPolicy(16, window=8))
        for _ in speculative(model, drafter, requests, shape):
            pass
    chunked, whole = runs
    for b in range(len(PROMPTS)):
        assert chunked[b].output_ids == ar[b], f"row {b}"
        assert whole[b].output_ids == ar[b], f"row {b}"
        assert chunked[b].stats.spec.accepted_at == whole[b].stats.spec.accepted_at


# ------------------------------------------------------------------------------------- prefix reuse


def test_identical_generation_reuses_the_prefill(models, monkeypatch):
    """The second generation of the same prompts runs no prefill forward and gives the same tokens;
    the pool counts it as reused."""
    model = models[0]
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)
    forwards = PrefillForwards(monkeypatch, model)
    first = generate(model, PROMPTS, GREEDY, pool)
    assert len(forwards.calls) == 1
    (runner,) = pool.runners()
    assert runner.cache.capacity % CAPACITY_STEP == 0 and runner.cache.prefix is not None
    second = generate(model, PROMPTS, GREEDY, pool)
    assert len(forwards.calls) == 1 and second == first
    assert pool.prefills.snapshot() == (1, 0, 1)  # computed, partial, reused
    assert pool.runners() == [runner]


def test_reuse_is_off_by_default(models, monkeypatch):
    """Without reuse_prefixes a CPU pool keeps nothing: every generation prefills a fresh cache."""
    model = models[0]
    pool = RunnerPool(use_graphs=True)
    forwards = PrefillForwards(monkeypatch, model)
    assert generate(model, PROMPTS, GREEDY, pool) == generate(model, PROMPTS, GREEDY, pool)
    assert len(forwards.calls) == 2 and pool.runners() == [] and pool.prefills.snapshot() == (0, 0, 0)


@pytest.mark.parametrize("chunked", [False, True])
def test_ar_then_self_speculation_reuses_and_equals_ar(models, monkeypatch, chunked):
    """AR, then streaming and SnapKV self-speculation, then AR again on the same prompts: each reuses
    the prefill — except SnapKV's first run, which re-runs it from its first watched chunk (here the
    first: the 5-token row's window starts at 0); its second run reuses that — and equals the AR output."""
    model = models[0]
    (small_chunks if chunked else whole_prompts)(monkeypatch)
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)
    forwards = PrefillForwards(monkeypatch, model)
    ar = generate(model, PROMPTS, GREEDY, pool)
    n_chunks = len(forwards.calls)
    assert n_chunks == (-(-max(LENGTHS) // CHUNK) if chunked else 1)

    streaming = SelfDrafter(model, StreamingPolicy(4, 12))
    assert generate(model, PROMPTS, GREEDY, pool, streaming) == ar
    assert len(forwards.calls) == n_chunks

    snapkv = SelfDrafter(model, SnapKVPolicy(16, window=8))
    assert generate(model, PROMPTS, GREEDY, pool, snapkv) == ar
    rerun = forwards.calls[n_chunks:]
    # the earliest window starts at position 0 (the 5-token row): the whole prompt is prefilled again
    assert rerun[0][0] == 0 and sum(t for _, t, _ in rerun) == max(LENGTHS)
    assert pool.prefills.snapshot() == (2, 0, 1)

    calls = len(forwards.calls)
    assert generate(model, PROMPTS, GREEDY, pool, snapkv, Tree.chain(2)) == ar
    assert generate(model, PROMPTS, GREEDY, pool) == ar
    assert len(forwards.calls) == calls and pool.prefills.snapshot() == (2, 0, 3)


def test_snapkv_rerun_starts_at_the_first_watched_chunk(models, monkeypatch):
    """Equal-length prompts (the benchmark's case): after AR, SnapKV re-runs only the last chunk (the one
    holding the observation window: its first 2 tokens in one forward, then the 8 window tokens observed)
    and selects exactly as a SnapKV run with no reuse."""
    model = models[0]
    small_chunks(monkeypatch)
    prompts = _prompts([90] * 3, seed=2)  # windows [82, 90): chunks 80.. only
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)
    forwards = PrefillForwards(monkeypatch, model)
    ar = generate(model, prompts, GREEDY, pool)
    reused = SelfDrafter(model, SnapKVPolicy(16, window=8))
    assert generate(model, prompts, GREEDY, pool, reused) == ar
    assert [(s, obs) for s, _, obs in forwards.calls[6:]] == expected_forwards([(82, 90)] * 3, 90)[5:]
    assert forwards.calls[6][0] == 80 and len(forwards.calls) == 6 + 1 + 8
    assert pool.prefills.snapshot() == (1, 1, 0)

    fresh = SelfDrafter(model, SnapKVPolicy(16, window=8))
    assert generate(model, prompts, GREEDY, RunnerPool(use_graphs=False), fresh) == ar
    for layer in range(model.config.num_layers):
        assert torch.equal(reused.policy.selected[layer], fresh.policy.selected[layer])
        assert torch.equal(reused.policy.selected_valid[layer], fresh.policy.selected_valid[layer])


@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
def test_standalone_draft_reuses_both_prefills(models, monkeypatch, policy):
    """A standalone draft keeps its own runner ("draft"). Run again with the same drafter, both prefills
    are reused (its SnapKV policy still holds its observation of that very draft prefill); the draft
    cache's prompt slots — the last one included, which the first draft step rewrote through the draft
    view — are put back exactly; the output is the target's."""
    target, draft_model = models
    small_chunks(monkeypatch)
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)

    def kv_policy():
        return StreamingPolicy(2, 10) if policy == "streaming" else SnapKVPolicy(12, window=4)

    drafter = ModelDrafter(draft_model, kv_policy(), target.config.vocab_size)
    ar = generate(target, PROMPTS, GREEDY, pool)
    assert generate(target, PROMPTS, GREEDY, pool, drafter) == ar
    assert pool.prefills.snapshot() == (2, 0, 1)  # target (AR) and draft computed; target reused
    cache = drafter.cache
    fresh = draft_model.new_cache(len(PROMPTS), 128)  # the draft's prefill, as its first run computed it
    reference = kv_policy()
    reference.start(torch.tensor(LENGTHS), draft_model.config.num_layers)
    with torch.inference_mode():
        prefill(draft_model, fresh, PROMPTS, observer=reference.prefill_observer())
    rows = range(len(PROMPTS))
    assert not all(torch.equal(cache.k[:, b, :, n - 1], fresh.k[:, b, :, n - 1]) for b, n in zip(rows, LENGTHS))

    t_calls, d_calls = PrefillForwards(monkeypatch, target), PrefillForwards(monkeypatch, draft_model)
    requests = make_requests(PROMPTS, [GREEDY] * len(PROMPTS), target.config, None)
    loop = speculative(target, drafter, requests, Tree.chain(3), "auto", pool)
    next(loop)  # the prefills are done and the first token is out; no draft step yet
    assert t_calls.calls == d_calls.calls == [] and drafter.cache is cache
    for b, n in zip(rows, LENGTHS):
        assert torch.equal(cache.k[:, b, :, :n], fresh.k[:, b, :, :n])
        assert torch.equal(cache.v[:, b, :, :n], fresh.v[:, b, :, :n])
    for _ in loop:
        pass
    assert [r.output_ids for r in requests] == ar
    assert pool.prefills.snapshot() == (2, 0, 3)


def test_changes_that_prefill_again(models, monkeypatch):
    """Other prompts (one token, or the row order), another batch size, a larger capacity than the kept
    cache, a reset, turning reuse off: the prefill runs again; back to the remembered prompts: reused."""
    model = models[0]
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)
    forwards = PrefillForwards(monkeypatch, model)

    def run(prompts, capacity=200):
        runner = pool.get("target", model, len(prompts), capacity)
        n = len(forwards.calls)
        with torch.inference_mode():
            logits = prefill(model, runner.cache, prompts)
        assert runner.cache.lengths.tolist() == [len(p) for p in prompts]
        return runner, logits, len(forwards.calls) > n

    runner, logits, ran = run(PROMPTS)
    assert ran
    again, same, ran = run(PROMPTS)
    assert not ran and again is runner and torch.equal(same, logits)
    changed = [list(p) for p in PROMPTS]
    changed[2][17] += 1
    assert run(changed)[2]
    assert run(PROMPTS)[2]
    assert run(PROMPTS[::-1])[2]
    assert run(PROMPTS)[2]
    assert run(PROMPTS[:3])[2]  # another batch size: another runner…
    assert not run(PROMPTS)[2]  # …and the first one still holds PROMPTS
    bigger, _, ran = run(PROMPTS, capacity=CAPACITY_STEP + 1)
    assert ran and bigger is not runner
    bigger.reset()
    assert run(PROMPTS)[2]
    pool.forget_prefixes()
    assert run(PROMPTS)[2]
    pool.reuse_prefixes = False
    assert pool.runners() == [] and run(PROMPTS)[2] and pool.runners() == []


def test_seeded_sampling_is_the_same_with_reuse(models):
    """Seeded sampling: the same tokens whether the prefill is computed or reused (AR and SnapKV
    self-speculation), and the same as without reuse."""
    model = models[0]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=10 + b)
              for b in range(len(PROMPTS))]
    plain = RunnerPool(use_graphs=False)
    pool = RunnerPool(use_graphs=False, reuse_prefixes=True)
    ar = generate(model, PROMPTS, params, plain)
    assert generate(model, PROMPTS, params, pool) == ar
    assert generate(model, PROMPTS, params, pool) == ar
    spec = generate(model, PROMPTS, params, plain, SelfDrafter(model, SnapKVPolicy(16, window=8)))
    drafter = SelfDrafter(model, SnapKVPolicy(16, window=8))
    assert generate(model, PROMPTS, params, pool, drafter) == spec
    assert generate(model, PROMPTS, params, pool, drafter) == spec
    assert pool.prefills.snapshot() == (2, 0, 2)  # AR: computed, reused; SnapKV: observed anew, reused
