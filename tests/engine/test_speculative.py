"""The speculative loop (draft → verify → commit): lossless against autoregressive decoding.

Tiny random Qwen2-style models on the CPU in float32. The target's attention output is scaled down and
its embeddings up, so its greedy choices have clear margins and do not hinge on every far-away token:
a noisy copy of it (the standalone draft) and its own compressed cache (self-speculation) then agree
with it often — acceptance well above 0 and below 1, so both the accept and the reject paths run.
"""

from __future__ import annotations

import pytest
import torch

from redwood import LLM, SamplingParams
from redwood.errors import ConfigError
from redwood.kv.policies import make_policy
from redwood.speculation.config import SpeculativeConfig
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.trees import Tree
from tests.conftest import clear_margin_model, make_tokenizer, perturbed, random_hf_model, tiny_hf_config
from tests.engine.driver import prefill_kv, run_engine

POLICIES = {
    "full": dict(),
    "streaming": dict(budget=16, sinks=4),  # 4 sinks + 12 recent
    "snapkv": dict(budget=16, window=4),  # 12 selected per KV head + the recent part
}
GAMMAS = [1, 3, 5]
NEW_TOKENS = 30


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


BATCHES = {"single": _prompts([57]), "ragged3": _prompts([40, 90, 65], seed=1)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    """target/ and draft/ (target + N(0, 0.01²) noise) sharing the conftest tokenizer; plus drafts with a
    larger and a smaller vocabulary (same ids on the shared range) and one with a different tokenizer."""
    root = tmp_path_factory.mktemp("spec-models")
    config = tiny_hf_config("qwen2", eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    target = clear_margin_model(config, seed=3)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    state = {k: v.clone() for k, v in target.state_dict().items()}

    draft = random_hf_model(config, seed=3)
    draft.load_state_dict(state)
    perturbed(draft, 0.01, seed=5).save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")

    for name, vocab in (("draft-big-vocab", config.vocab_size + 32), ("draft-small-vocab", 300)):
        cfg = tiny_hf_config(
            "qwen2", vocab_size=vocab, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
        )
        m = random_hf_model(cfg, seed=4)
        resized = {}
        for k, v in state.items():
            if v.shape[:1] == (config.vocab_size,):  # embeddings / lm_head rows: the shared range
                w = m.state_dict()[k].clone()
                n = min(vocab, config.vocab_size)
                w[:n] = v[:n]
                resized[k] = w
            else:
                resized[k] = v
        m.load_state_dict(resized)
        perturbed(m, 0.01, seed=6).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)

    other_tok = make_tokenizer(vocab_size=300)
    other_tok.save_pretrained(root / "draft-other-tokenizer")
    draft.save_pretrained(root / "draft-other-tokenizer")
    return root


@pytest.fixture(scope="module")
def target_llm(model_dirs):
    return LLM(str(model_dirs / "target"))


@pytest.fixture(scope="module")
def draft_llm(model_dirs):
    return LLM(str(model_dirs / "draft"))


@pytest.fixture(scope="module")
def ar_outputs(target_llm):
    """Greedy autoregressive outputs of each batch (the reference)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return {name: [o.token_ids for o in target_llm.generate(prompts, params)] for name, prompts in BATCHES.items()}


def make_drafter(kind: str, policy_name: str, target_llm, draft_llm):
    policy = make_policy(policy_name, **POLICIES[policy_name])
    if kind == "self":
        return SelfDrafter(target_llm.model, policy)
    return ModelDrafter(draft_llm.model, policy, target_llm.config.vocab_size)


def run_speculative(llm, drafter, prompts, params, gamma, monkeypatch=None, verifier="auto", configure=None, **kw):
    """Run prompts through an Engine with this drafter; → (RequestStates, {row: [Snapshot…]})."""
    tree = gamma if isinstance(gamma, Tree) else Tree.chain(gamma)
    _, states, snaps = run_engine(
        llm.model,
        llm.tokenizer,
        prompts,
        params,
        drafter=drafter,
        tree=tree,
        verifier=verifier,
        configure=configure,
        **kw,
    )
    return states, snaps


def run_ar(llm, prompts, params, configure=None, **kw):
    _, states, _ = run_engine(llm.model, llm.tokenizer, prompts, params, configure=configure, **kw)
    return states


def assert_target_cache_is_autoregressive(model, snaps, requests):
    """When each request ends, its committed slots [0, L) hold the KV a prefill of prompt + output[:L − p]
    computes (the newest token is sampled but not yet fed; the last step commits nothing)."""
    for b, r in enumerate(requests):
        snap = snaps[b][-1]
        L = snap.length
        tokens = r.prompt_ids + r.output_ids
        assert len(r.prompt_ids) <= L < len(tokens), f"row {b}: cache holds {L} of {len(tokens)} tokens"
        k, v = prefill_kv(model, tokens[:L])
        torch.testing.assert_close(snap.k, k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(snap.v, v, rtol=1e-4, atol=1e-5)


def assert_draft_cache_consistent(drafter: ModelDrafter, snaps, requests, policy_name):
    """The standalone draft's cache, up to the tokens it has been fed: with the full policy, exactly the
    draft model's own prefill KV of the same tokens. With a compressed policy the generated tokens' KV is
    the draft's own compressed-view forward (the policy's definition), so there we check the prompt part
    (minus its last token, which the first step re-feeds) in every layer and token/position placement
    everywhere through layer 0 (whose K/V depend on nothing else)."""
    for b, r in enumerate(requests):
        snap = snaps[b][-1]
        n = snap.draft_length
        assert n <= snap.length
        tokens = (r.prompt_ids + r.output_ids)[:n]
        k, v = prefill_kv(drafter.model, tokens)
        if policy_name == "full":
            torch.testing.assert_close(snap.draft_k, k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(snap.draft_v, v, rtol=1e-4, atol=1e-5)
        else:
            p = len(r.prompt_ids) - 1
            torch.testing.assert_close(snap.draft_k[:, :, :p], k[:, :, :p], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(snap.draft_v[:, :, :p], v[:, :, :p], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(snap.draft_k[0], k[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(snap.draft_v[0], v[0], rtol=1e-4, atol=1e-5)


def assert_stats_sane(stats: dict, gamma: int, generated: int, agreeing: bool = True):
    s = stats["speculative"]
    assert s["gamma"] == gamma and s["steps"] >= 1
    # γ per step, fewer on the eager tail steps cut to what the row can still emit (Executor._step_tree)
    assert s["steps"] <= s["drafted"] <= gamma * s["steps"]
    assert 0 <= s["accepted"] <= s["drafted"]
    if agreeing:
        assert 0 < s["acceptance_rate"] <= 1
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-4)
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / s["steps"], abs=1e-4)
    by_pos = s["acceptance_by_position"]
    assert len(by_pos) == gamma and all(0 <= x <= 1 for x in by_pos)
    assert all(a >= b for a, b in zip(by_pos, by_pos[1:])), by_pos  # accepting d_i needs d_1…d_{i−1}
    assert sum(by_pos) * s["steps"] == pytest.approx(s["accepted"], abs=1e-3 * s["steps"])
    counts = s["accepted_by_position"]  # the exact counts behind the rates
    assert sum(counts) == s["accepted"] and [round(c / s["steps"], 4) for c in counts] == by_pos
    # The first token comes from the prefill; each step emits a + 1, the last one possibly cut short by
    # a stop inside its drafts (accepted counts the drafts emitted: one bonus too many); a greedy last
    # step with one token left drafts nothing and is no speculation step.
    assert generated - 2 <= s["steps"] + s["accepted"] <= generated
    assert s["draft_s"] > 0 and s["verify_s"] > 0


# ------------------------------------------------------------------------------------------- greedy == AR


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("kind", ["standalone", "self"])
def test_greedy_speculative_equals_autoregressive(
    kind, policy_name, batch, gamma, target_llm, draft_llm, ar_outputs, monkeypatch
):
    prompts = BATCHES[batch]
    drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests, cache = run_speculative(target_llm, drafter, prompts, params, gamma, monkeypatch)
    for b, r in enumerate(requests):
        assert r.output_ids == ar_outputs[batch][b], f"row {b} (prompt of {len(r.prompt_ids)} tokens)"
        assert r.finish_reason == "length"
        stats = r.stats.to_dict()
        assert_stats_sane(stats, gamma, NEW_TOKENS)
        if kind == "self" and policy_name == "full":  # the draft is the target: everything is accepted
            assert stats["speculative"]["acceptance_rate"] == 1.0
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
    if kind == "standalone":
        assert_draft_cache_consistent(drafter, cache, requests, policy_name)


def test_compressed_drafts_really_compress(target_llm, draft_llm, monkeypatch):
    """Sanity of the setup: with budget 16 over 40–90-token prompts the compressed self-draft proposes
    differently from the full one (so the matrix above exercises compression), yet still agrees often."""
    prompts = BATCHES["ragged3"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for policy_name in ("streaming", "snapkv"):
        drafter = make_drafter("self", policy_name, target_llm, draft_llm)
        requests, _ = run_speculative(target_llm, drafter, prompts, params, 3, monkeypatch)
        rates = [r.stats.spec.accepted / r.stats.spec.drafted for r in requests]
        assert all(0.1 < x < 1.0 for x in rates), (policy_name, rates)


@pytest.mark.parametrize("draft_name", ["draft-big-vocab", "draft-small-vocab"])
def test_draft_with_different_vocab_size_uses_shared_range(draft_name, model_dirs, target_llm, ar_outputs):
    spec = SpeculativeConfig(draft_model=str(model_dirs / draft_name), num_draft_tokens=3)
    llm = LLM(str(model_dirs / "target"), speculative=spec)
    outs = llm.generate(BATCHES["ragged3"], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == ar_outputs["ragged3"]
    assert all(o.stats["speculative"]["acceptance_rate"] > 0 for o in outs)
    # A draft with the smaller vocabulary never proposes a token outside it, but the target still can.
    d = llm.drafter
    logits = torch.randn(2, d.model.config.vocab_size)[:, : d.shared_vocab]  # _draft keeps the shared range
    q = d.pad_to_target(_greedy_sampler(2).probs(logits))
    assert q.shape == (2, target_llm.config.vocab_size)
    assert (q[:, llm.drafter.shared_vocab :] == 0).all()


def _greedy_sampler(n):
    from redwood.sample.sampler import Sampler

    return Sampler([SamplingParams()] * n, torch.device("cpu"))


def test_draft_with_different_tokenizer_is_an_error(model_dirs):
    spec = SpeculativeConfig(draft_model=str(model_dirs / "draft-other-tokenizer"))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        LLM(str(model_dirs / "target"), speculative=spec)


# ------------------------------------------------------------------------------------------- per-row finish

FINISH_PROMPTS = _prompts([90, 40, 65], seed=2)
DRAFT_CASES = [("self", "streaming"), ("self", "snapkv"), ("standalone", "full"), ("standalone", "snapkv")]


@pytest.mark.parametrize("kind,policy_name", DRAFT_CASES)
def test_rows_finish_independently_max_new_tokens(kind, policy_name, target_llm, draft_llm, monkeypatch):
    """Per-row max_new_tokens: the row that sized the cache (longest prompt) stops first — possibly in the
    middle of an accepted run — and the others go on; every row equals its own AR output."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 30, 21)]
    ar = [r.output_ids for r in run_ar(target_llm, FINISH_PROMPTS, params)]
    for gamma in (3, 5):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache = run_speculative(target_llm, drafter, FINISH_PROMPTS, params, gamma, monkeypatch)
        assert [r.output_ids for r in requests] == ar
        assert [len(r.output_ids) for r in requests] == [12, 30, 21]
        assert all(r.finish_reason == "length" for r in requests)
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)


def _mode(mode, target_llm, draft_llm):
    if mode == "autoregressive":
        return dict()
    drafter = make_drafter(mode, "streaming" if mode == "self" else "full", target_llm, draft_llm)
    return dict(drafter=drafter, tree=Tree.chain(3))


@pytest.mark.parametrize("mode", ["autoregressive", "self", "standalone"])
def test_finished_rows_are_marked_dead_in_the_cache(mode, target_llm, draft_llm):
    """After every step the target cache marks exactly the generating rows live (live 0: its forwards read
    none of its context, redwood.kv.cache): finished rows' slots are vacated on the step they finish."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 30, 21)]
    seen = {"mixed": False}

    def check(engine, states):
        live = engine.cache.live.tolist()
        running = {r.slot: r for r in engine._requests.values() if r.slot is not None}
        for row, flag in enumerate(live):
            rec = running.get(row)
            assert flag == (1 if rec is not None and not rec.seq.is_prefilling else 0), (row, live)
        seen["mixed"] |= 0 < sum(live) < len(live)

    engine, _, _ = run_engine(
        target_llm.model,
        target_llm.tokenizer,
        FINISH_PROMPTS,
        params,
        on_step=check,
        **_mode(mode, target_llm, draft_llm),
    )
    assert seen["mixed"] and engine.cache.live.tolist() == [0, 0, 0]


@pytest.mark.parametrize("mode", ["autoregressive", "self", "standalone"])
def test_timings_leave_out_one_time_graph_captures(mode, target_llm, draft_llm, monkeypatch):
    """A graph capture (here: a forward that takes CAPTURE_S longer once and books it as the runner's
    capture time, as StepRunner does on CUDA) is charged to no decode, step, draft or verify time."""
    import time

    from redwood.engine.runner import StepRunner

    CAPTURE_S = 1.0
    forward = StepRunner.forward
    first = [True]

    def forward_capturing_once(self, *args, **kwargs):
        if first[0]:
            first[0] = False
            t = time.perf_counter()
            time.sleep(CAPTURE_S)
            self.capture_s += time.perf_counter() - t  # what the "capture" took, as StepRunner books one
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "forward", forward_capturing_once)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 30, 21)]
    t0 = time.perf_counter()
    engine, states, _ = run_engine(
        target_llm.model, target_llm.tokenizer, FINISH_PROMPTS, params, **_mode(mode, target_llm, draft_llm)
    )
    assert not first[0] and engine.capture_s >= CAPTURE_S
    assert time.perf_counter() - t0 > CAPTURE_S  # the capture did happen in this run
    for r in states:
        assert 0 < r.stats.decode_s < CAPTURE_S
        if mode != "autoregressive":
            spec = r.stats.spec
            assert 0 < spec.step_s < CAPTURE_S and spec.draft_s + spec.verify_s < CAPTURE_S


@pytest.mark.parametrize("kind,policy_name", DRAFT_CASES)
def test_eos_stops_only_its_row(kind, policy_name, target_llm, draft_llm, monkeypatch):
    """Declare a token of row 0's free run its EOS: row 0 ends right at it (maybe inside an accepted
    run); row 2 has no EOS and runs to max_new_tokens; all equal the AR outputs with the same EOS."""
    free = run_ar(target_llm, FINISH_PROMPTS[:1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0].output_ids
    eos_tok = free[5]

    def configure(requests):
        requests[0].eos_ids = frozenset({eos_tok})
        requests[1].eos_ids = frozenset({eos_tok})  # may or may not occur in row 1
        requests[2].eos_ids = frozenset()

    params = SamplingParams(max_new_tokens=30)
    ar = run_ar(target_llm, FINISH_PROMPTS, params, configure)
    drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
    requests, cache = run_speculative(target_llm, drafter, FINISH_PROMPTS, params, 4, monkeypatch, configure=configure)
    assert [r.output_ids for r in requests] == [r.output_ids for r in ar]
    assert [r.finish_reason for r in requests] == [r.finish_reason for r in ar]
    assert requests[0].output_ids == free[: free.index(eos_tok) + 1] and requests[0].finish_reason == "stop"
    assert len(requests[2].output_ids) == 30 and requests[2].finish_reason == "length"
    assert_target_cache_is_autoregressive(target_llm.model, cache, requests)


def test_stop_strings_per_row(target_llm, model_dirs):
    """A stop string ends its row with the same text and tokens as AR decoding; other rows go on."""
    prompts = ["The quick brown", "def add(a, b):", "Paris is the capital"]
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    free = target_llm.generate(prompts, greedy)
    assert len(free[1].text) > 8
    stop = free[1].text[4:7]
    params = [greedy, SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)), greedy]
    ar = target_llm.generate(prompts, params)
    assert ar[1].finish_reason == "stop" and stop not in ar[1].text
    for spec in (
        SpeculativeConfig(self_speculate=True, draft_kv="streaming", draft_budget=8, sinks=2, num_draft_tokens=4),
        SpeculativeConfig(draft_model=str(model_dirs / "draft"), num_draft_tokens=4),
    ):
        llm = LLM(str(model_dirs / "target"), speculative=spec)
        outs = llm.generate(prompts, params)
        assert [(o.text, o.token_ids, o.finish_reason) for o in outs] == [
            (o.text, o.token_ids, o.finish_reason) for o in ar
        ]


# ------------------------------------------------------------------------------------------- API, sampling


def test_llm_api_speculative_generate_and_stream(model_dirs, ar_outputs):
    prompts = BATCHES["ragged3"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for spec in (
        SpeculativeConfig(self_speculate=True, draft_kv="snapkv", draft_budget=16, window=4, num_draft_tokens=3),
        SpeculativeConfig(
            draft_model=str(model_dirs / "draft"), draft_kv="streaming", draft_budget=16, num_draft_tokens=5
        ),
    ):
        llm = LLM(str(model_dirs / "target"), speculative=spec)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == ar_outputs["ragged3"]
        for o in outs:
            assert_stats_sane(o.stats, spec.num_draft_tokens, NEW_TOKENS)
        ids, finals = [[] for _ in prompts], [None] * len(prompts)
        for d in llm.stream(prompts, params):
            ids[d.index] += d.token_ids
            if d.finish_reason:
                finals[d.index] = d.stats
        assert ids == ar_outputs["ragged3"]
        assert all(f is not None and "speculative" in f for f in finals)


@pytest.mark.parametrize("kind,policy_name", [("self", "streaming"), ("standalone", "full"), ("standalone", "snapkv")])
def test_sampling_reproducible_and_batch_independent(kind, policy_name, target_llm, draft_llm, monkeypatch):
    prompts = BATCHES["ragged3"]
    params = [
        SamplingParams(temperature=0.8, seed=100 + i, max_new_tokens=20, ignore_eos=True) for i in range(len(prompts))
    ]

    def run(rows, prms):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache = run_speculative(target_llm, drafter, [prompts[i] for i in rows], prms, 3, monkeypatch)
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)
        return [r.output_ids for r in requests]

    a = run([0, 1, 2], params)
    assert run([0, 1, 2], params) == a
    assert run([1], [params[1]]) == [a[1]]
    assert run([2, 0], [params[2], params[0]]) == [a[2], a[0]]
    other = run(
        [0, 1, 2], [SamplingParams(temperature=0.8, seed=7 + i, max_new_tokens=20, ignore_eos=True) for i in range(3)]
    )
    assert other != a
    assert all(len(x) == 20 for x in a)


def test_mixed_greedy_and_sampled_rows(target_llm, draft_llm, ar_outputs, monkeypatch):
    """One batch, one greedy and two seeded sampled rows (so the sampling verifier runs for all): the
    greedy row still equals greedy AR decoding, the sampled rows equal their runs without it."""
    prompts = BATCHES["ragged3"]
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=12, max_new_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] + sampled
    for kind, policy_name in (("self", "snapkv"), ("standalone", "streaming")):
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        requests, cache = run_speculative(target_llm, drafter, prompts, params, 3, monkeypatch)
        assert requests[0].output_ids == ar_outputs["ragged3"][0]
        drafter = make_drafter(kind, policy_name, target_llm, draft_llm)
        alone, _ = run_speculative(target_llm, drafter, prompts[1:], sampled, 3, monkeypatch)
        assert [r.output_ids for r in requests[1:]] == [r.output_ids for r in alone]
        assert_target_cache_is_autoregressive(target_llm.model, cache, requests)


# ------------------------------------------------------------------------------------------- γ near the end


def test_drafts_are_cut_to_what_the_request_can_still_emit(target_llm, draft_llm, ar_outputs):
    """γ 8 with 4 new tokens: the prefill gives the first, so one step can emit at most 3 — it drafts 2,
    not 8 (eager steps), and the stats count the tokens emitted, not those verified."""
    prompts = BATCHES["single"]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    # the target drafting for itself over its full cache: every draft token is accepted
    requests, _ = run_speculative(target_llm, make_drafter("self", "full", target_llm, draft_llm), prompts, params, 8)
    assert requests[0].output_ids == ar_outputs["single"][0][:4]
    s = requests[0].stats.to_dict()["speculative"]
    assert (s["gamma"], s["steps"], s["drafted"], s["accepted"]) == (8, 1, 2, 2)
    assert s["mean_accepted_length"] == 3.0
    # a standalone draft (some drafts rejected): never more drafts than tokens left, and exact counts
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    requests, _ = run_speculative(
        target_llm, make_drafter("standalone", "full", target_llm, draft_llm), prompts, params, 8
    )
    assert requests[0].output_ids == ar_outputs["single"][0][:6]
    s = requests[0].stats.to_dict()["speculative"]
    assert s["drafted"] <= 4 * s["steps"] and s["steps"] + s["accepted"] == 5


def test_stats_count_only_emitted_tokens():
    from redwood.engine.request import SpecStats

    s = SpecStats(gamma=60)
    s.record(60, emitted=7, drafted=60)  # a stop after 7 of the 61 verified tokens
    d = s.to_dict()
    assert (d["accepted"], d["drafted"], d["mean_accepted_length"]) == (7, 60, 8.0)
    assert d["accepted_by_position"][:8] == [1] * 7 + [0]
    s.record(2)  # (nothing cut: accepted + the bonus)
    assert s.to_dict()["mean_accepted_length"] == (7 + 2 + 2) / 2
    s.record(3, emitted=4, drafted=3)  # a step whose bonus was emitted: nothing to cut
    assert s.to_dict()["accepted"] == 7 + 2 + 3
