"""Draft KV policies against straightforward references: which committed slots a drafter reads.

- streaming: exactly the first `sinks` slots plus the last `window` committed slots;
- snapkv: the top (budget − window) prefix positions per layer and KV head, scored by the observation
  window's attention (a loop-by-loop reference below), plus the decode rule for the recent part;
- settings validation (make_policy, SpeculativeConfig).
"""

from __future__ import annotations

import math

import pytest
import torch

from redwood.config import ModelConfig
from redwood.errors import ConfigError
from redwood.kv.policies import FullPolicy, SnapKVPolicy, StreamingPolicy, make_policy
from redwood.models.transformer import Transformer
from redwood.speculation.config import SpeculativeConfig


def valid_slots(idx: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """The slot indices marked valid in one row/head (as a sorted list, duplicates kept)."""
    return sorted(idx[valid].tolist())


# ------------------------------------------------------------------------------------------- streaming


def streaming_reference(L: int, sinks: int, window: int) -> list[int]:
    return sorted(set(range(min(sinks, L))) | set(range(max(L - window, 0), L)))


@pytest.mark.parametrize("sinks", [0, 1, 4, 7])
@pytest.mark.parametrize("window", [1, 3, 8, 20])
def test_streaming_keeps_sinks_and_last_window(sinks, window):
    lengths = torch.tensor(list(range(0, 70)) + [200, 1000, 4097])  # L < sinks, L ≤ sinks+window, L ≫
    policy = StreamingPolicy(sinks, window)
    idx, valid = policy.indices(lengths)
    assert idx.shape == valid.shape == (len(lengths), sinks + window)  # constant size: cost does not grow
    for b, L in enumerate(lengths.tolist()):
        slots = valid_slots(idx[b], valid[b])
        assert slots == streaming_reference(L, sinks, window), f"L={L}"  # sorted list: no duplicates either
        assert len(slots) == min(L, sinks + window)
    # The view is shared by every layer and KV head.
    i0, v0 = policy.view(lengths)(0)
    i1, v1 = policy.view(lengths)(1)
    assert i0.shape == (len(lengths), 1, sinks + window)
    assert torch.equal(i0, i1) and torch.equal(v0, v1)
    assert torch.equal(i0[:, 0][v0[:, 0]], idx[valid])


# ------------------------------------------------------------------------------------------- snapkv


def snapkv_reference(
    q: torch.Tensor, k: torch.Tensor, lengths: list[int], budget: int, window: int, kernel: int, pool: str
):
    """Selection of one layer, written with loops: per row b and KV head h,

    1. every observation query i (the last `window` prompt tokens, i < L) attends to keys 0…i
       (float32 softmax, causal in the window);
    2. the attention is summed over the window queries, per query head, and cut to the prefix
       [0, L − window);
    3. pooled along the sequence with `kernel` (avg: sum of the in-prefix neighbours / kernel, i.e. zero
       padding as in SnapKV; max: max over the in-prefix neighbours);
    4. summed over the query heads of the KV group;
    5. the top min(budget − window, prefix) positions are kept.
    Returns {(b, h): (selected set, scores list)}.
    """
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    r = kernel // 2
    out = {}
    for b in range(B):
        L = lengths[b]
        n_prefix = max(L - window, 0)
        for h in range(Hkv):
            total = [0.0] * n_prefix
            for g in range(G):
                hq = h * G + g
                votes = [0.0] * L
                for i in range(max(L - window, 0), L):
                    logits = (k[b, h, : i + 1].float() @ q[b, hq, i].float()) / math.sqrt(D)
                    attn = torch.softmax(logits, dim=0)
                    for j in range(i + 1):
                        votes[j] += float(attn[j])
                prefix = votes[:n_prefix]
                for x in range(n_prefix):
                    neigh = [prefix[j] for j in range(x - r, x + r + 1) if 0 <= j < n_prefix]
                    total[x] += sum(neigh) / kernel if pool == "avg" else max(neigh)
            K = min(max(budget - window, 0), n_prefix)
            top = sorted(range(n_prefix), key=lambda x: -total[x])[:K]
            out[b, h] = (set(top), total)
    return out


def assert_same_selection(got: set[int], want: set[int], scores: list[float], what: str) -> None:
    """Equal sets — or, at a float near-tie at the cut, swapped positions whose scores are equal to 1e-5."""
    if got == want:
        return
    assert len(got) == len(want), what
    cut = min(scores[x] for x in want)
    for x in got ^ want:
        assert abs(scores[x] - cut) <= 1e-5 * max(1.0, abs(cut)), f"{what}: {sorted(got)} != {sorted(want)}"


def run_observe(policy: SnapKVPolicy, q_layers, k_layers, lengths: list[int]) -> None:
    policy.start(torch.tensor(lengths), len(q_layers))
    for layer, (q, k) in enumerate(zip(q_layers, k_layers)):
        policy.observe(layer, q, k, mask=None)


def random_qk(B, Hq, Hkv, S, D, layers, seed):
    g = torch.Generator().manual_seed(seed)
    # Scaled so attention is peaked (selection is not decided by tiny differences).
    qs = [torch.randn(B, Hq, S, D, generator=g) * 1.5 for _ in range(layers)]
    ks = [torch.randn(B, Hkv, S, D, generator=g) for _ in range(layers)]
    return qs, ks


@pytest.mark.parametrize(
    "budget,window,kernel,pool,Hq,Hkv",
    [
        (16, 4, 5, "avg", 4, 2),
        (16, 4, 5, "max", 4, 2),
        (12, 6, 3, "avg", 6, 2),  # window not tied to the GQA ratio
        (20, 1, 7, "avg", 4, 4),  # MHA; window smaller than kernel // 2
        (20, 2, 7, "max", 8, 1),  # MQA
        (10, 10, 5, "avg", 4, 2),  # budget = window: nothing selected
        (9, 3, 1, "avg", 4, 2),  # no pooling
    ],
)
def test_snapkv_selection_matches_loop_reference(budget, window, kernel, pool, Hq, Hkv):
    lengths = [37, 12, 50, 5, 24]  # ragged; one shorter than the window plus budget, one barely longer
    S = max(lengths)
    qs, ks = random_qk(len(lengths), Hq, Hkv, S, 8, layers=2, seed=budget * 100 + window)
    policy = SnapKVPolicy(budget, window=window, kernel=kernel, pool=pool)
    run_observe(policy, qs, ks, lengths)
    for layer in range(2):
        ref = snapkv_reference(qs[layer], ks[layer], lengths, budget, window, kernel, pool)
        sel, sel_valid = policy.selected[layer], policy.selected_valid[layer]
        for b in range(len(lengths)):
            for h in range(Hkv):
                got = sel[b, h][sel_valid[b, h]].tolist()
                assert len(got) == len(set(got))
                want, scores = ref[b, h]
                assert_same_selection(set(got), want, scores, f"layer {layer} row {b} head {h}")


@pytest.mark.parametrize("chunk", [1, 5, 7, 16])
@pytest.mark.parametrize("window,kernel,pool", [(4, 5, "avg"), (6, 3, "max"), (1, 1, "avg")])
def test_snapkv_chunked_observation_matches_loop_reference(chunk, window, kernel, pool):
    """Forwards of `chunk` queries each (q of positions [a, b), keys [0, b)), observed only where the
    policy watches: the same selection as the reference; votes are freed after the last forward."""
    lengths = [37, 12, 50, 5, 24]
    S = max(lengths)
    qs, ks = random_qk(len(lengths), 4, 2, S, 8, layers=2, seed=chunk * 10 + window)
    policy = SnapKVPolicy(window + 10, window=window, kernel=kernel, pool=pool)
    policy.start(torch.tensor(lengths), 2)
    watched = []
    for a in range(0, S, chunk):
        b = min(a + chunk, S)
        if policy.observes(a, b):
            watched.append(a)
            for layer in range(2):
                policy.at(a)(layer, qs[layer][:, :, a:b], ks[layer][:, :, :b], None)
    if chunk <= 5:
        assert len(watched) < -(-S // chunk)  # some forwards are not observed
    assert all(v is None for v in policy._votes)
    policy.finish()
    for layer in range(2):
        ref = snapkv_reference(qs[layer], ks[layer], lengths, window + 10, window, kernel, pool)
        for b in range(len(lengths)):
            for h in range(2):
                got = policy.selected[layer][b, h][policy.selected_valid[layer][b, h]].tolist()
                assert_same_selection(set(got), *ref[b, h], f"chunk {chunk} layer {layer} row {b} head {h}")


def test_snapkv_finish_needs_every_window_query():
    policy = SnapKVPolicy(12, window=4)
    policy.start(torch.tensor([20, 9]), 1)
    qs, ks = random_qk(2, 4, 2, 20, 8, layers=1, seed=0)
    policy.at(0)(0, qs[0][:, :, :16], ks[0][:, :, :16], None)  # the forward of [16, 20) never comes
    with pytest.raises(RuntimeError, match="saw every observation-window query"):
        policy.finish()


def test_snapkv_heads_and_layers_select_differently():
    lengths = [60]
    qs, ks = random_qk(1, 4, 2, 60, 8, layers=2, seed=5)
    policy = SnapKVPolicy(20, window=8)
    run_observe(policy, qs, ks, lengths)
    sets = {(layer, h): set(policy.selected[layer][0, h].tolist()) for layer in range(2) for h in range(2)}
    assert len({frozenset(s) for s in sets.values()}) > 1


def test_snapkv_selection_is_batch_independent():
    """A row's selection does not depend on the other rows (padding, the batch's longest prompt)."""
    lengths = [41, 9, 28, 33]
    S = max(lengths)
    for window, kernel in [(1, 7), (2, 5), (4, 5)]:
        qs, ks = random_qk(len(lengths), 4, 2, S, 8, layers=1, seed=window)
        batch = SnapKVPolicy(14, window=window, kernel=kernel)
        run_observe(batch, qs, ks, lengths)
        for b, L in enumerate(lengths):
            alone = SnapKVPolicy(14, window=window, kernel=kernel)
            run_observe(alone, [qs[0][b : b + 1, :, :L]], [ks[0][b : b + 1, :, :L]], [L])
            for h in range(2):
                got = set(batch.selected[0][b, h][batch.selected_valid[0][b, h]].tolist())
                want = set(alone.selected[0][0, h][alone.selected_valid[0][0, h]].tolist())
                assert got == want, f"window {window} kernel {kernel} row {b} head {h}"


def snapkv_view_reference(policy: SnapKVPolicy, layer: int, b: int, h: int, L: int) -> list[int]:
    """Decode rule: the selected positions + the most recent (budget − #selected) tokens from the
    observation window on."""
    sel = policy.selected[layer][b, h][policy.selected_valid[layer][b, h]].tolist()
    obs_start = max(int(policy.prompt_lengths[b]) - policy.window, 0)
    recent = range(max(L - (policy.budget - len(sel)), obs_start), L)
    return sorted(set(sel) | set(recent))


def test_snapkv_decode_rule():
    prompt = [37, 12, 50, 5]
    budget, window = 16, 4
    qs, ks = random_qk(len(prompt), 4, 2, max(prompt), 8, layers=2, seed=9)
    policy = SnapKVPolicy(budget, window=window)
    run_observe(policy, qs, ks, prompt)
    for extra in range(0, 45):
        lengths = torch.tensor(prompt) + extra
        view = policy.view(lengths)
        for layer in range(2):
            idx, valid = view(layer)
            assert idx.shape[:2] == (len(prompt), 2)
            for b, L in enumerate(lengths.tolist()):
                for h in range(2):
                    slots = valid_slots(idx[b, h], valid[b, h])
                    assert slots == snapkv_view_reference(policy, layer, b, h, L)  # (sorted: no duplicates)
                    assert len(slots) <= budget and all(0 <= s < L for s in slots)
                    if L >= budget:  # enough context: the budget is used in full
                        assert len(slots) == budget
    # At prefill the recent part is exactly the observation window (prompt longer than the budget).
    idx, valid = policy.view(torch.tensor(prompt))(0)
    slots = set(valid_slots(idx[0, 0], valid[0, 0]))
    assert set(range(prompt[0] - window, prompt[0])) <= slots


@pytest.mark.parametrize("budget", [50, 64, 80])
def test_snapkv_budget_at_least_prompt_is_full_cache(budget):
    prompt = [50, 21, 7]
    qs, ks = random_qk(len(prompt), 4, 2, 50, 8, layers=2, seed=budget)
    policy = SnapKVPolicy(budget, window=8)
    run_observe(policy, qs, ks, prompt)
    for extra in range(0, 40):
        lengths = torch.tensor(prompt) + extra
        view = policy.view(lengths)
        for layer in range(2):
            idx, valid = view(layer)
            for b, L in enumerate(lengths.tolist()):
                for h in range(2):
                    slots = valid_slots(idx[b, h], valid[b, h])
                    if L <= budget:
                        assert slots == list(range(L))  # every committed slot, once
                    else:  # generation outgrew the budget: still within it
                        assert len(slots) == budget


def tiny_transformer(seed=0) -> Transformer:
    config = ModelConfig(
        arch="llama",
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


class RecordingSnapKV(SnapKVPolicy):
    """SnapKV that keeps the q / k each layer's (single-chunk) prefill forward showed it."""

    def __init__(self, seen: dict, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = seen

    def observe(self, layer, q, k, mask=None, q_start=0):
        self.seen[layer] = (q.clone(), k.clone())
        super().observe(layer, q, k, mask, q_start)


@torch.inference_mode()
def test_snapkv_through_a_model_prefill():
    """The observer sees each layer's prefill q/k; the selection equals the reference on those; a budget
    ≥ the prompt gives the same logits as the full cache."""
    from redwood.engine.prefill import prefill_batch as prefill

    model = tiny_transformer()
    prompts = [list(range(3, 43)), list(range(10, 27))]
    seen = {}
    for budget in (12, 64):
        policy = RecordingSnapKV(seen, budget, window=4, kernel=3)
        policy.start(torch.tensor([len(p) for p in prompts]), 2)
        cache = model.new_cache(2, 64)
        prefill(model, cache, prompts, observer=policy.prefill_observer())
        for layer in range(2):
            q, k = seen[layer]
            ref = snapkv_reference(q, k, [len(p) for p in prompts], budget, 4, 3, "avg")
            for b in range(2):
                for h in range(2):
                    got = set(policy.selected[layer][b, h][policy.selected_valid[layer][b, h]].tolist())
                    assert_same_selection(got, *ref[b, h], f"budget {budget} layer {layer} row {b} head {h}")
        # A draft-style forward of one more token through the view vs the full cache.
        nxt = torch.tensor([[5], [6]])
        pos = cache.lengths[:, None]
        viewed = model(nxt, pos, cache, view=policy.view(cache.lengths))
        full = model(nxt, pos, cache)
        if budget >= max(len(p) for p in prompts):
            torch.testing.assert_close(viewed, full, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.allclose(viewed[0], full[0], atol=1e-4)  # row 0 (40 tokens) is compressed


# ------------------------------------------------------------------------------------------- validation


def test_make_policy_builds_each_policy():
    assert isinstance(make_policy("full"), FullPolicy)
    s = make_policy("streaming", budget=20)
    assert isinstance(s, StreamingPolicy) and (s.sinks, s.window) == (4, 16)
    s = make_policy("streaming", sinks=0, window=5)
    assert (s.sinks, s.window) == (0, 5)
    s = make_policy("streaming", budget=12, sinks=2, window=10)
    assert (s.sinks, s.window) == (2, 10)
    k = make_policy("snapkv", budget=64)
    assert isinstance(k, SnapKVPolicy) and (k.budget, k.window, k.kernel, k.pool) == (64, 32, 5, "avg")
    k = make_policy("snapkv", budget=10, window=3, kernel=7, pool="max")
    assert (k.budget, k.window, k.kernel, k.pool) == (10, 3, 7, "max")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="lru", budget=8), "unknown draft KV policy"),
        (dict(name="streaming"), "needs --draft-budget or --window"),
        (dict(name="streaming", budget=4), "window >= 1"),  # budget = sinks (default 4): no window
        (dict(name="streaming", budget=3), "window >= 1"),  # budget < sinks
        (dict(name="streaming", budget=6, sinks=8), "window >= 1"),  # budget < sinks
        (dict(name="streaming", budget=10, sinks=2, window=5), "!= sinks"),
        (dict(name="streaming", sinks=-1, window=5), "sinks >= 0"),
        (dict(name="streaming", sinks=2, window=0), "window >= 1"),
        (dict(name="snapkv"), "needs --draft-budget"),
        (dict(name="snapkv", budget=0, window=1), "budget >= 1"),
        (dict(name="snapkv", budget=16, window=-2), "window >= 1"),
        (dict(name="snapkv", budget=16, window=4, kernel=4), "odd"),
        (dict(name="snapkv", budget=16, window=4, kernel=0), "odd"),
        (dict(name="snapkv", budget=16, window=4, pool="mean"), "'avg' or 'max'"),
        (dict(name="snapkv", budget=8, window=16), "window"),  # budget < observation window
        (dict(name="snapkv", budget=16), "window"),  # default window 32 > budget
    ],
)
def test_make_policy_errors(kwargs, match):
    kwargs = dict(kwargs)
    with pytest.raises(ConfigError, match=match):
        make_policy(kwargs.pop("name"), **kwargs)


def test_speculative_config_valid():
    c = SpeculativeConfig(self_speculate=True, draft_kv="streaming", draft_budget=16, sinks=2)
    p = c.make_policy()
    assert isinstance(p, StreamingPolicy) and (p.sinks, p.window) == (2, 14)
    c = SpeculativeConfig(draft_model="some-draft", draft_kv="snapkv", draft_budget=24, window=8, pool_kernel=3)
    p = c.make_policy()
    assert isinstance(p, SnapKVPolicy) and (p.budget, p.window, p.kernel) == (24, 8, 3)
    assert SpeculativeConfig(self_speculate=True).num_draft_tokens >= 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), "exactly one of"),
        (dict(draft_model="d", self_speculate=True), "exactly one of"),
        (dict(draft_model=""), "exactly one of"),
        (dict(self_speculate=True, draft_kv="quest"), "unknown draft_kv"),
        (dict(self_speculate=True, num_draft_tokens=0), "num_draft_tokens"),
        (dict(self_speculate=True, num_draft_tokens=-3), "num_draft_tokens"),
        (dict(self_speculate=True, num_draft_tokens=2.5), "num_draft_tokens"),
        (dict(self_speculate=True, verifier="typical"), "unknown verifier"),
        (dict(self_speculate=True, draft_kv="streaming", draft_budget=0), "draft_budget"),
        (dict(self_speculate=True, draft_kv="streaming", draft_budget=-8), "draft_budget"),
        (dict(self_speculate=True, draft_kv="streaming", window=0), "window"),
        (dict(self_speculate=True, draft_kv="streaming", sinks=-1, window=4), "sinks"),
        (dict(self_speculate=True, draft_kv="streaming", draft_budget=3, sinks=4), "window >= 1"),
        (dict(self_speculate=True, draft_kv="streaming"), "draft-budget"),
        (dict(self_speculate=True, draft_kv="snapkv"), "draft-budget"),
        (dict(self_speculate=True, draft_kv="snapkv", draft_budget=8, window=16), "window"),
        (dict(self_speculate=True, draft_kv="snapkv", draft_budget=64, pool_kernel=2), "odd"),
        (dict(draft_model="d", draft_weights="int3"), "unknown draft_weights 'int3'; choose one of auto, float32"),
        (dict(draft_model="d", draft_weights=None), "unknown draft_weights None"),
        (
            dict(self_speculate=True, draft_weights="int8"),
            "draft_weights applies to a draft model; self-speculation drafts with the target",
        ),
        (dict(draft_model="d", draft_tensor_parallel="half"), "unknown draft_tensor_parallel 'half'; choose one of"),
        (dict(self_speculate=True, draft_tensor_parallel="replicate"), "draft_tensor_parallel places a draft model"),
        (dict(draft_model="d", draft_tensor_parallel=0), "or a number of ranks >= 1, got 0"),
        (dict(draft_model="d", draft_tensor_parallel=True), "or a number of ranks >= 1, got True"),
        (dict(draft_model="d", draft_tensor_parallel=2.0), "or a number of ranks >= 1, got 2.0"),
        (dict(self_speculate=True, draft_tensor_parallel=2), "draft_tensor_parallel places a draft model"),
    ],
)
def test_speculative_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig(**kwargs)
