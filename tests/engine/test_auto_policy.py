"""The automatic policy through the Engine (redwood.speculation.policy.AutoPolicy): plan switches between steps —
forced every step, and as the real policy makes them — keep greedy output equal to AR's token for token under
continuous batching; a draft model that sat out steps is caught up, so its KV equals a fresh prefill's; the
stats say which plans ran; `--speculative auto` on the command line. (Sampled exactness under switching:
tests/bench/test_lossless.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from redwood import SamplingParams
from redwood.kv.policies import FullPolicy, StreamingPolicy
from redwood.speculation.drafters import ModelDrafter, SelfDrafter
from redwood.speculation.draftless import NgramDrafter
from redwood.speculation.policy import DRAFTLESS_GAMMAS, MAX_GAMMA, AutoPolicy, Plan
from tests.engine.driver import RecordingEngine, prefill_kv, repetitive_prompts, run_engine
from tests.engine.test_engine import models  # noqa: F401 — the (target, draft, tokenizer) fixture


@pytest.fixture(autouse=True)
def costs_in_tmp(tmp_path, monkeypatch):
    """Calibrations go to a fresh folder, not the user's cache."""
    import redwood.speculation.costs_cache as cache

    monkeypatch.setattr(cache, "costs_dir", lambda: tmp_path / "costs")


def cycle_plans(monkeypatch, order=None):
    """Make AutoPolicy.plan run its candidates in turn, one per step (every switch the policy could make)."""

    def plan(self, rows, bucket, prefill_backlog_steps=0, backlog_decodes=0):
        self.steps += 1
        for s in self.shadows:
            for r in rows:
                s.before(r.slot, r.token_ids, r.params.temperature)
        cands = self.candidates if order is None else [self.candidates[i] for i in order]
        return Plan(cands[self.steps % len(cands)])

    monkeypatch.setattr(AutoPolicy, "plan", plan)


def auto_engine(target, tok, drafters, **kw):
    return RecordingEngine.build(target, tok, auto_drafters=drafters, block_size=8, **kw)


ARRIVALS = [0, 0, 1, 3, 5, 9]


@pytest.mark.parametrize("self_draft", [False, True], ids=["draft-model", "self-streaming"])
def test_plans_switching_every_step_keep_greedy_equal_to_ar(models, monkeypatch, self_draft):
    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True) for _ in prompts]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, max_num_seqs=3, block_size=8)
    # (the candidates backwards: prompt lookup's longest chains, past the model drafters' γ 8, come first)
    cycle_plans(monkeypatch, order=list(range(MAX_GAMMA + len(DRAFTLESS_GAMMAS), -1, -1)))
    first = SelfDrafter(target, StreamingPolicy(2, 10)) if self_draft else ModelDrafter(draft, FullPolicy(), 320)
    engine = auto_engine(target, tok, [first, NgramDrafter(320, 1, 3)], max_num_seqs=3)
    _, spec, snaps = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    plans = {}
    for s in spec:
        for name, n in s.stats.spec.plans.items():
            plans[name] = plans.get(name, 0) + n
    assert "ar" in plans and all(any(n.startswith(f) for n in plans) for f in ("ngram", first.family))
    assert {"ngram γ10", "ngram γ12", "ngram γ16"} & set(plans)  # (prompt lookup past the model drafters' γ 8)
    assert sum(s.output_sources.count("draft") for s in spec) > 0
    if not self_draft:  # the draft model's cache holds what a fresh prefill of the same tokens would
        for i, s in enumerate(spec):
            snap = snaps[i][-1]
            tokens = (s.prompt_ids + s.output_ids)[: snap.draft_length]
            k, v = prefill_kv(draft, tokens)
            n = min(snap.draft_length, len(tokens)) - 1  # (its newest slot is re-fed on the next step)
            torch.testing.assert_close(snap.draft_k[..., :n, :], k[..., :n, :], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(snap.draft_v[..., :n, :], v[..., :n, :], atol=2e-5, rtol=1e-4)


def test_the_real_policy_keeps_greedy_equal_to_ar_and_reports_its_plans(models):
    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=7)
    params = [SamplingParams(max_new_tokens=48, ignore_eos=True) for _ in prompts]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, max_num_seqs=3, block_size=8)
    engine = auto_engine(target, tok, [ModelDrafter(draft, FullPolicy(), 320), NgramDrafter(320, 1, 3)], max_num_seqs=3)
    _, spec, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    report = engine.policy.report()
    assert sum(report["plans"].values()) > 0 and report["probes"] > 0
    assert report["draftless_scored"]["ngram"] > 0
    assert set(report["acceptance"]) >= {"ngram@t0"}
    d = spec[0].stats.spec.to_dict()
    assert d["policy"] == "auto" and sum(d["plans"].values()) > 0


def test_steps_behind_a_prefill_backlog_decode_plainly_and_greedy_stays_equal(models):
    """Many requests at once, long prompts, short outputs, a small prefill budget: while the queued prefills
    outlast every decoding row, the policy plans plain steps (counted in its report); output equals AR's."""
    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=11)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True) for _ in prompts]
    kw = dict(max_num_seqs=6, max_num_batched_tokens=8)
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=[0] * 6, block_size=8, **kw)
    engine = auto_engine(target, tok, [ModelDrafter(draft, FullPolicy(), 320), NgramDrafter(320, 1, 3)], **kw)
    _, spec, _ = run_engine(target, tok, prompts, params, arrivals=[0] * 6, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    report = engine.policy.report()
    assert report["prefill_bound_steps"] > 0 and report["plans"]["ar"] >= report["prefill_bound_steps"]


def test_prefill_bound_steps_ask_for_draftless_proposals_while_the_device_works(models):
    """With `defer_scoring` (a GPU), a step planned plainly behind a prefill backlog asks the draftless drafters
    for its proposals in the job run between the step's launches and its read-back, not in `plan`: no proposal
    is asked for inside a prefill-bound plan, the step's proposals are still scored, and output equals AR's."""
    from redwood.speculation.acceptance_live import ShadowScorer

    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=11)
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True) for _ in prompts]
    kw = dict(max_num_seqs=6, max_num_batched_tokens=8)
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=[0] * 6, block_size=8, **kw)
    engine = auto_engine(target, tok, [NgramDrafter(320, 1, 3)], **kw)
    engine.policy.defer_scoring = True
    policy, where = engine.policy, {"bound plan": 0, "other plan": 0, "in-step": 0}
    plan, before, run_alongside, state = AutoPolicy.plan, ShadowScorer.before, engine.executor._run_alongside, {}

    def planning(self, *a, **k):
        bound0, state["in"] = self.prefill_bound_steps, "plan"
        try:
            out = plan(self, *a, **k)
        finally:
            state["in"] = None
        state["bound"] = self.prefill_bound_steps > bound0
        return out

    def asking(self, *a):
        if state.get("in") == "plan":
            state["asked"] = state.get("asked", 0) + 1
        elif state.get("in") == "step":
            where["in-step"] += 1
        return before(self, *a)

    def alongside():
        state["in"] = "step"
        try:
            run_alongside()
        finally:
            state["in"] = None

    def counting_plan(self, *a, **k):
        state["asked"] = 0
        out = planning(self, *a, **k)
        where["bound plan" if state["bound"] else "other plan"] += state["asked"]
        return out

    AutoPolicy.plan, ShadowScorer.before = counting_plan, asking
    engine.executor._run_alongside = alongside
    try:
        _, spec, _ = run_engine(target, tok, prompts, params, arrivals=[0] * 6, engine=engine)
    finally:
        AutoPolicy.plan, ShadowScorer.before = plan, before
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert policy.report()["prefill_bound_steps"] > 0
    assert where["bound plan"] == 0 and where["in-step"] > 0, where
    assert policy.report()["draftless_scored"]["ngram"] > 0 and policy._deferred is None


def test_shadow_scoring_deferred_into_the_next_step_keeps_greedy_equal_to_ar(models):
    """With `defer_scoring` (on a GPU) each step's shadow scoring runs inside the next step, between its launches
    and its read-back; requests finish (their counts settled first) and come in under continuous batching: output
    equals AR's, proposals are scored (most of them inside a step), and the report settles what is left."""
    from redwood.speculation.acceptance_live import ShadowScorer

    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=5)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True) for _ in prompts]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, max_num_seqs=3, block_size=8)
    engine = auto_engine(target, tok, [NgramDrafter(320, 1, 3)], max_num_seqs=3)
    engine.policy.defer_scoring = True
    where = {"in-step": 0, "outside": 0}
    settle, run_alongside, inside = ShadowScorer.settle, engine.executor._run_alongside, [False]

    def recording(self, *a):
        where["in-step" if inside[0] else "outside"] += 1
        settle(self, *a)

    def alongside():
        inside[0] = True
        try:
            run_alongside()
        finally:
            inside[0] = False

    ShadowScorer.settle = recording
    engine.executor._run_alongside = alongside
    try:
        _, spec, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, engine=engine)
    finally:
        ShadowScorer.settle = settle
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    # (outside: a finishing request's last step, settled as it leaves)
    assert where["in-step"] > where["outside"] > 0, where
    assert engine.policy.report()["draftless_scored"]["ngram"] > 0 and engine.policy._deferred is None


def test_plans_made_while_the_device_works_keep_greedy_equal_to_ar(models):
    """With `defer_scoring` (a GPU) each plan's costs and the draft model's expectations are worked out during the
    step before (`AutoPolicy._plan_ahead_alongside`), and prompt lookup's indexes register the step's tokens there
    (`NgramDrafter.lazy`): under continuous batching — requests leaving and coming, the draft model's catch-ups —
    output equals AR's, plans were made ahead, and the jobs registered what the plans had only appended."""
    target, draft, tok = models
    prompts = repetitive_prompts(6, seed=6)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in prompts]
    _, ar, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, max_num_seqs=3, block_size=8)
    engine = auto_engine(target, tok, [ModelDrafter(draft, FullPolicy(), 320), NgramDrafter(320, 1, 3)], max_num_seqs=3)
    engine.policy.defer_scoring = True
    ngram = engine.policy.drafters[1]
    assert ngram.lazy  # (its indexes register a step's tokens in the job, not in the plan)
    behind = []  # per job: the tokens its rows' indexes had appended but not registered
    register = ngram.register_pending

    def registering(slots):
        behind.append(sum(len(ngram._rows[s].tokens) - ngram._rows[s].indexed for s in slots if s in ngram._rows))
        register(slots)
        assert all(ngram._rows[s].indexed == len(ngram._rows[s].tokens) for s in slots if s in ngram._rows)

    ngram.register_pending = registering
    _, spec, _ = run_engine(target, tok, prompts, params, arrivals=ARRIVALS, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    assert sum(b > 0 for b in behind) > 10, behind
    report = engine.policy.report()
    planned = sum(report["plans"].values()) - report["prefill_bound_steps"]
    assert 0 < report["planned_ahead"] < planned, report  # (not after a row left or came, nor the first)


@pytest.mark.parametrize("ignore_eos", [True, False], ids=["eos-ignored", "eos-may-end"])
def test_the_policy_is_told_what_the_prefill_backlog_will_decode(models, ignore_eos):
    """Each plan gets the backlog's steps and the tokens its requests are sure to decode afterwards: all of their
    max_new_tokens with EOS ignored (every step with a backlog is then planned plainly: no running row can
    outlast the rows still prefilling), none when EOS may end them; output equals AR's either way."""
    target, draft, tok = models
    prompts = repetitive_prompts(5, seed=12, copies=(10, 14), tail=(0, 1))
    params = [SamplingParams(max_new_tokens=24, ignore_eos=ignore_eos) for _ in prompts]
    kw = dict(max_num_seqs=5, max_num_batched_tokens=8)
    _, ar, _ = run_engine(target, tok, prompts, params, block_size=8, **kw)
    engine = auto_engine(target, tok, [NgramDrafter(320, 1, 3)], **kw)
    seen = []  # (backlog steps, what it will decode, the rows' most remaining tokens, the plan's family)
    plan = engine.policy.plan

    def recording(rows, bucket, backlog=0, backlog_decodes=0):
        p = plan(rows, bucket, backlog, backlog_decodes)
        seen.append((backlog, backlog_decodes, max(r.remaining for r in rows), p.family))
        return p

    engine.policy.plan = recording
    _, spec, _ = run_engine(target, tok, prompts, params, engine=engine)
    assert [s.output_ids for s in spec] == [s.output_ids for s in ar]
    behind = [x for x in seen if x[0] > 0]
    assert len(behind) > 5 and all(decodes == (24 if ignore_eos else 0) for _, decodes, _, _ in behind)
    assert any(most > backlog for backlog, _, most, _ in behind)  # (steps the backlog alone leaves free to speculate)
    if ignore_eos:
        assert all(family == "ar" for *_, family in behind)
        assert engine.policy.report()["prefill_bound_steps"] == len(behind)


def test_llm_with_the_auto_policy_and_no_model_drafter(tiny_model_dir):
    """SpeculativeConfig(policy="auto") alone: plain decoding and the ngram drafter; greedy == AR."""
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = LLM(str(tiny_model_dir)).generate(prompt, p)[0]
    llm = LLM(str(tiny_model_dir), speculative=SpeculativeConfig(policy="auto", ngram_min=1))
    out = llm.generate(prompt, p)[0]
    assert out.token_ids == ar.token_ids and out.text == ar.text
    assert llm.draft_name.startswith("auto") and out.stats["speculative"]["policy"] == "auto"


def test_generate_speculative_auto_on_the_command_line(tiny_model_dir, tiny_draft_dir, capsys):
    from redwood.cli import main

    prompt = "def add(a, b): return a + b\ndef add(a, b):"
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-new-tokens", "12", "--ignore-eos"]
    assert main(args + ["--json"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--speculative", "auto", "--draft-model", str(tiny_draft_dir)]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["token_ids"] == ar["token_ids"]
    assert set(obj["policy"]) >= {"plans", "probes", "expected_tokens_per_step", "acceptance"}
    assert main(args + ["--speculative", "auto"]) == 0
    assert "speculative auto" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, msg",
    [
        (["--speculative", "auto", "--gamma", "3"], "--gamma pins a fixed plan"),
        (["--speculative", "auto", "--tree", "chain:3"], "--tree pins a fixed plan"),
        (["--speculative", "auto", "--draft-model", "d", "--self-speculate"], "one model drafter"),
    ],
)
def test_auto_flag_errors(flags, msg, tmp_path, capsys):
    from redwood.cli import main

    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"] + flags) == 2
    err = capsys.readouterr().err
    assert msg in err, err


def test_an_acceptance_file_seeds_the_model_drafter(tmp_path):
    from redwood.errors import ConfigError
    from redwood.speculation.config import SpeculativeConfig

    f = tmp_path / "acc.json"
    f.write_text(
        json.dumps(
            {"format": "redwood.acceptance/1", "values": [0.7, 0.1], "per_depth": [[0.8], [0.6]], "temperature": 0.6}
        )
    )
    spec = SpeculativeConfig(self_speculate=True, policy="auto", acceptance_file=str(f))
    assert spec.seed_rates() == ([0.8, 0.6], 0.6)
    with pytest.raises(ConfigError, match="needs policy='auto'"):
        SpeculativeConfig(self_speculate=True, acceptance_file=str(f))
    with pytest.raises(ConfigError, match="model drafter"):
        SpeculativeConfig(policy="auto", acceptance_file=str(f))
    with pytest.raises(ConfigError, match="not found"):
        SpeculativeConfig(self_speculate=True, policy="auto", acceptance_file=str(tmp_path / "nope.json"))
    f.write_text(json.dumps({"format": "redwood.acceptance/1", "values": [0.7, 0.6]}))  # sums past 1
    with pytest.raises(ConfigError, match="sums to"):
        SpeculativeConfig(self_speculate=True, policy="auto", acceptance_file=str(f))


def test_the_seed_reaches_the_engines_policy(tiny_model_dir, tmp_path):
    from redwood import LLM
    from redwood.speculation.config import SpeculativeConfig

    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"format": "redwood.acceptance/1", "values": [0.9], "temperature": 0}))
    spec = SpeculativeConfig(
        self_speculate=True, draft_kv="streaming", draft_budget=16, policy="auto", acceptance_file=str(f)
    )
    llm = LLM(str(tiny_model_dir), speculative=spec)
    # worth 16 reaches against the flat prior's 2 (at 0.6)
    assert llm.engine.policy.acceptance.overall("self", 0.0)[0] == pytest.approx((16 * 0.9 + 2 * 0.6) / 18)
    assert llm.engine.policy.acceptance.overall("self", 0.7)[0] == pytest.approx(0.6)  # (another bucket: the prior)
