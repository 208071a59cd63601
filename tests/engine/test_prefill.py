"""Prefill: SnapKV observation through a chunked prefill, and the Engine's prefix cache.

Tiny random Qwen2-style models on the CPU in float32 (the target's greedy choices have clear margins; the
standalone draft is a noisy copy of it). Small prefill chunks are forced by monkeypatching
`MIN_PREFILL_CHUNK` / `PREFILL_SCORE_BUDGET`, with ragged prompts whose observation windows straddle
chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

import redwood.engine.prefill as gen
from redwood import LLM, SamplingParams
from redwood.engine.prefill import prefill_batch
from redwood.kv.policies import SnapKVPolicy, StreamingPolicy
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree
from tests.conftest import save_target_and_draft
from tests.engine.driver import run_engine
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


def generate(model, prompts, params, drafter=None, tree=None, **kw) -> list[list[int]]:
    """Output token ids of the prompts through an Engine (autoregressive when no drafter)."""
    _, states, _ = run_engine(
        model, None, prompts, params, drafter=drafter, tree=None if drafter is None else (tree or Tree.chain(3)), **kw
    )
    return [r.output_ids for r in states]


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
    logits = prefill_batch(model, cache, prompts, observer=policy.prefill_observer())
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
                assert_same_selection(
                    set(got), set(want), want_scores[b, h].tolist(), f"layer {layer} row {b} head {h}"
                )


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
    from redwood.engine.executor import Executor
    from redwood.speculation.trees import resolve_tree

    model = models[0]
    shape = resolve_tree(tree)
    small_chunks(monkeypatch)
    ar = generate(model, PROMPTS, GREEDY)
    # Every step drafts the whole tree: the tail cut (`Executor._step_tree`) follows the longest row of
    # each step, so it would differ between these schedules and so would the tail steps' acceptance.
    monkeypatch.setattr(Executor, "_step_tree", lambda self, tree, rows, graphed, greedy: tree)
    runs = []
    for setup, step_tokens in ((small_chunks, 16), (small_chunks, 2048), (whole_prompts, 2048)):
        setup(monkeypatch)  # forwards of 16 tokens or whole prompts; steps of 16 prompt tokens or all
        drafter = SelfDrafter(model, SnapKVPolicy(16, window=8))
        _, states, _ = run_engine(
            model, None, PROMPTS, GREEDY, drafter=drafter, tree=shape, max_num_batched_tokens=step_tokens
        )
        runs.append(states)
    for b in range(len(PROMPTS)):
        for states in runs:
            assert states[b].output_ids == ar[b], f"row {b}"
            assert states[b].stats.spec.accepted_at == runs[-1][b].stats.spec.accepted_at


# ------------------------------------------------------------------------------------- prefix cache


def _shared_prompts():
    """Two prompts sharing a 48-token prefix (three 16-token blocks) and one unrelated prompt."""
    g = torch.Generator().manual_seed(9)
    common = torch.randint(3, 300, (48,), generator=g).tolist()
    return [common + [5, 6, 7, 8, 9], common + [11, 12], torch.randint(3, 300, (30,), generator=g).tolist()]


@pytest.mark.parametrize("mode", ["ar", "self-streaming", "self-snapkv", "standalone-snapkv"])
def test_prefix_cache_shares_blocks_and_changes_nothing(models, monkeypatch, mode):
    """With prefix caching, a request whose prompt starts with a finished request's full blocks prefills
    only the rest (SnapKV: never its observation window) and generates exactly what it does without."""
    target, draft = models
    prompts = _shared_prompts()

    def drafter():
        if mode == "ar":
            return None
        policy = StreamingPolicy(4, 12) if mode == "self-streaming" else SnapKVPolicy(16, window=8)
        return (
            SelfDrafter(target, policy)
            if mode.startswith("self")
            else ModelDrafter(draft, policy, target.config.vocab_size)
        )

    plain = generate(target, prompts, GREEDY, drafter())
    forwards = PrefillForwards(monkeypatch, target)
    # request 1 arrives after request 0 has finished (its blocks are cached, refcount 0)
    engine, states, _ = run_engine(
        target,
        None,
        prompts,
        GREEDY,
        drafter=drafter(),
        tree=None if mode == "ar" else Tree.chain(3),
        arrivals=[0, 30, 31],
        enable_prefix_caching=True,
        block_size=16,
        max_num_seqs=2,
    )
    assert [r.output_ids for r in states] == plain
    starts = [s for s, _, _ in forwards.calls]
    limit = 48 if "snapkv" not in mode else (50 - 8) // 16 * 16  # SnapKV computes the last 8 prompt tokens
    assert limit in starts, starts  # request 1's prefill began after its cached blocks
    assert engine.pool.num_used == 0 and engine.pool.num_cached > 0


def test_blocks_are_all_free_after_finish_and_abort(models):
    """Every block returns to the pool whether requests finish or are aborted mid-way (prefilling or
    decoding), and the untouched requests' outputs are unchanged."""
    target, _ = models
    plain = generate(target, PROMPTS, GREEDY)
    engine, states, _ = run_engine(
        target, None, PROMPTS, GREEDY, aborts={1: 3, 3: 0}, block_size=16, max_num_batched_tokens=16
    )
    for b in (0, 2, 4):
        assert states[b].output_ids == plain[b]
    assert states[3].finish_reason == "abort" and states[1].finish_reason == "abort"
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.num_blocks
    assert engine.cache.live.sum() == 0


def test_a_last_chunk_near_the_context_end_beside_a_longer_chunk(models, tokenizer):
    """Batched prefill pads chunks to the longest; a row whose last chunk ends near max_model_len, beside
    a longer chunk of another row, would pad past the end of its page table (it raised "KV cache full"
    at 64 rows × 32K on the H200). Such rows prefill alone: both requests still give their solo output."""
    from redwood.engine.engine import Engine

    target, _ = models
    long_prompt, other = _prompts([62, 49], seed=5)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)

    def engine():
        return Engine.build(
            target, tokenizer, max_num_seqs=2, max_model_len=64, block_size=8, max_num_batched_tokens=56
        )

    def solo(prompt):
        e = engine()
        e.add_request(prompt, params, request_id="x")
        out = []
        while e.has_unfinished():
            out += [t for d in e.step() for t in d.token_ids]
        return out

    e = engine()
    e.add_request(long_prompt, params, request_id="a")
    outs = {"a": [], "b": []}
    for d in e.step():  # a: tokens [0, 56)
        outs[d.request_id] += d.token_ids
    e.add_request(other, params, request_id="b")  # next step: a [56, 62) at start 56 beside b's 49 tokens
    while e.has_unfinished():
        for d in e.step():
            outs[d.request_id] += d.token_ids
    assert outs == {"a": solo(long_prompt), "b": solo(other)}


def test_a_batched_prefill_checks_the_capacity_without_reading_lengths_back(models, tokenizer, monkeypatch):
    """Each forward of a batched prefill checks its slots against the capacity through a bound it knows on the
    host (on a GPU a read-back of the lengths would drain the queue before every forward, and host work after
    the prefill could not overlap it): every check inside `prefill_rows` has a bound, and it is the rows' real
    longest length, chunk after chunk. The output is the solo output's."""
    import redwood.engine.executor as executor_module
    from redwood.engine.engine import Engine
    from redwood.kv.cache import KVCache

    target, _ = models
    prompts = _prompts([40, 29, 35], seed=7)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    seen, inside = [], [False]
    slots, prefill_rows = KVCache.slots, executor_module.prefill_rows

    def checking(self, num_new, offset=0):
        if inside[0]:
            seen.append((self.length_bound, int(self.lengths.max())))
        return slots(self, num_new, offset)

    def prefilling(*a, **k):
        inside[0] = True
        try:
            return prefill_rows(*a, **k)
        finally:
            inside[0] = False

    def run(patch: bool):
        if patch:
            monkeypatch.setattr(KVCache, "slots", checking)
            monkeypatch.setattr(executor_module, "prefill_rows", prefilling)
        e = Engine.build(target, tokenizer, max_num_seqs=3, block_size=8, max_num_batched_tokens=48)
        for i, p in enumerate(prompts):
            e.add_request(p, params, request_id=str(i))
        outs = {str(i): [] for i in range(len(prompts))}
        while e.has_unfinished():
            for d in e.step():
                outs[d.request_id] += d.token_ids
        return outs

    want = run(False)
    assert run(True) == want
    assert len(seen) >= 3 and all(bound == longest for bound, longest in seen), seen


def test_a_host_length_bound_guards_the_capacity():
    """`KVCache.length_bound`: past the capacity raises as the read-back check does; int commits move it, a
    per-row commit (a tensor) drops it; the cache's views start without one."""
    from redwood.config import ModelConfig
    from redwood.errors import ContextLengthError
    from redwood.kv.cache import KVCache
    from tests.conftest import tiny_hf_config

    cfg = ModelConfig.from_hf_dict(tiny_hf_config("qwen2").to_dict())
    cache = KVCache.paged(cfg, 2, 8, 8, 32, torch.float32, "cpu")
    sub = cache.select([0, 1])
    sub.lengths.copy_(torch.tensor([5, 9]))
    sub.length_bound = 9
    assert sub.slots(23).shape == (2, 23)  # slots up to 31: the last one
    with pytest.raises(ContextLengthError, match="33 tokens needed"):
        sub.slots(24)
    sub.commit(4)
    assert sub.length_bound == 13 and sub.lengths.tolist() == [9, 13]
    sub.commit(torch.tensor([1, 0]))
    assert sub.length_bound is None
    sub.length_bound = 13
    assert all(v.length_bound is None for v in (sub.rows(1), sub.row(0), sub.select([1])))
