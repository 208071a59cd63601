"""The automatic policy's choice (redwood.speculation.policy): the plan it picks equals a brute-force search over
its candidates on synthetic cost tables and acceptance; with costs where speculation loses it picks plain
decoding; it keeps its plan against small gains (hysteresis); it probes the families it did not choose, ever
more rarely, and a probe that wins switches the plan."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from redwood.sampling_params import SamplingParams
from redwood.speculation.acceptance_live import expected_chain_tokens
from redwood.speculation.costs import CATCH_UP, CostModel, CostTable, ForwardCurve
from redwood.speculation.policy import (
    AR,
    DRAFTLESS_GAMMAS,
    MAX_AR_PROBE_INTERVAL,
    MAX_GAMMA,
    PROBE_EVERY,
    AutoPolicy,
    Plan,
)


class FakePolicy:
    def __init__(self, reads=None):
        self._reads = reads

    def reads(self):
        return self._reads


class ModelDraft:
    family, needs_history, standalone = "draft", False, True
    own_model = object()
    policy = FakePolicy()


class SelfDraft:
    family, needs_history, own_model, standalone = "self", False, None, False
    policy = FakePolicy(reads=64)


class Draftless:
    family, needs_history, own_model, standalone = "ngram", True, None, False
    policy = FakePolicy()
    proposal = [1] * 8  # what it proposes at every step (its acceptance is seeded by the tests)

    def grow(self, rows):
        pass  # (no index)

    def shadow_propose(self, slot, history, k):
        return self.proposal[:k]


@dataclass
class Row:
    slot: int
    computed: int = 100
    params: SamplingParams = field(default_factory=SamplingParams)
    token_ids: list = field(default_factory=lambda: [1, 2, 3])
    remaining: int = 64  # tokens its request may still emit


def table(rng: random.Random) -> CostTable:
    def one(scale):
        tokens = [1, 2, 4, 8, 16]
        lo, t = [], scale
        for _ in tokens:
            lo.append(t)
            t *= 1 + rng.uniform(0.0, 0.9)  # forwards over more tokens cost more, by a random factor
        return ForwardCurve(tokens, 16, 1040, lo, [x * rng.uniform(1.0, 1.5) for x in lo])

    return CostTable(one(1.0), one(rng.uniform(0.05, 0.5)))


def policy_with(costs: CostTable, rates: dict[str, list[float]], margin: float = 0.0) -> AutoPolicy:
    p = AutoPolicy([ModelDraft(), Draftless()], margin=margin)
    p.costs = CostModel(costs)
    for family, r in rates.items():
        p.acceptance.seed(family, 0.0, r, weight=1e6)
    return p


def brute_force(p: AutoPolicy, rows, bucket: int):
    best, best_rate = None, -1.0
    for c in p.candidates:
        seconds = p.costs.raw(c.shape, bucket, int(sum(r.computed for r in rows) / len(rows)), live=len(rows))
        if c.tree is None:
            e = 1.0
        else:  # (a draftless drafter's chain offers no more than its proposal)
            gamma = c.tree.size - 1
            if c.drafter.needs_history:
                gamma = min(gamma, len(c.drafter.proposal))
            e = sum(expected_chain_tokens(p.acceptance.rates(c.family, r.slot, 0.0), gamma) for r in rows) / len(rows)
        rate = e * len(rows) / seconds
        if rate > best_rate:
            best, best_rate = c, rate
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_equals_brute_force(seed):
    rng = random.Random(seed)
    rates = {"draft": [rng.uniform(0.2, 0.95) for _ in range(8)], "ngram": [rng.uniform(0.0, 0.95) for _ in range(16)]}
    p = policy_with(table(rng), rates)
    p.drafters[1].proposal = [1] * rng.choice([3, 8, 12, 16])  # (the chains past it expect no more)
    rows = [Row(slot=i, computed=rng.randrange(20, 900)) for i in range(rng.choice([1, 2, 3]))]
    bucket = 4 if len(rows) > 2 else len(rows)
    assert p.plan(rows, bucket).candidate == brute_force(p, rows, bucket)


def test_when_speculation_loses_it_decodes_plainly():
    # a verify of N tokens costs N plain steps; drafts cost something: no chain can pay
    lin = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16])
    p = policy_with(CostTable(lin, lin), {"draft": [0.99] * 8, "ngram": [0.99] * 8})
    assert p.plan([Row(0)], 1).name == "ar"


def test_a_small_gain_does_not_switch_the_plan():
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])  # verifies cost what a plain step does
    p = AutoPolicy([Draftless()], margin=0.05)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.04] + [0.0] * 7, weight=1e6)  # +4% expected: under the margin
    assert p.plan([Row(0)], 1).name == "ar"
    p.acceptance.seed("ngram", 0.0, [0.2] + [0.0] * 7, weight=1e6)  # +20%: switches
    assert p.plan([Row(0)], 1).name.startswith("ngram")


def test_unchosen_families_are_probed_ever_more_rarely_and_a_winning_probe_switches():
    lin = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16])
    p = policy_with(CostTable(lin, lin), {"draft": [0.1] * 8, "ngram": [0.0] * 8})
    probes = {}
    for step in range(1, 200):
        plan = p.plan([Row(0)], 1)
        if plan.probe:
            probes.setdefault(plan.family, []).append(step)
        else:
            assert plan.name == "ar"
    assert min(min(steps) for steps in probes.values()) == PROBE_EVERY
    assert probes["draft"][0] in (PROBE_EVERY, PROBE_EVERY + 1)  # (two families due at once: one a step later)
    gaps = [b - a for a, b in zip(probes["draft"], probes["draft"][1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backing off
    assert "ngram" in probes
    # costs change (a probe measured the draft family far cheaper than the table said): it wins and stays
    for _ in range(50):
        p.costs.observe("draft", p.candidates[1].shape, 1, 1, 100, 1e-3)
    p.acceptance.seed("draft", 0.0, [0.9] * 8, weight=1e6)
    assert p.plan([Row(0)], 1).family == "draft"


def test_draftless_chains_go_past_the_model_drafters_cap():
    """A draftless drafter's levels cost no draft forward: its chains are planned up to γ 16, a model drafter's to
    MAX_GAMMA. Where verify width costs little (a flat curve: a batch's step reading long contexts) and its proposals
    are accepted, the longest chain its proposal fills wins; the KV lookahead and the acceptance tables follow."""
    flat = ForwardCurve([1, 2, 4, 8, 16, 32], 16, 1040, [1.0, 1.0, 1.0, 1.02, 1.05, 1.1], [1.0] * 5 + [1.1])
    drafter = Draftless()
    drafter.proposal = [1] * 16
    p = AutoPolicy([ModelDraft(), drafter], margin=0.0)
    p.costs = CostModel(CostTable(flat, ForwardCurve([1, 32], 16, 1040, [1e-3, 1e-3], [1e-3, 1e-3])))
    names = {c.name for c in p.candidates}
    assert {f"ngram γ{g}" for g in DRAFTLESS_GAMMAS} <= names and "ngram γ16" in names and "ngram γ9" not in names
    assert {c.name for c in p.candidates if c.family == "draft"} == {f"draft γ{g}" for g in range(1, MAX_GAMMA + 1)}
    assert p.max_tree_size == 17 and p.depth == {"draft": MAX_GAMMA, "ngram": 16}
    p.acceptance.seed("draft", 0.0, [0.9] * 8, weight=1e6)
    p.acceptance.seed("ngram", 0.0, [0.95] * 16, weight=1e6)
    assert len(p.acceptance.overall("ngram", 0.0)) == 16 and len(p.acceptance.overall("draft", 0.0)) == MAX_GAMMA
    assert p.plan([Row(0, remaining=1000)], 1).name == "ngram γ16"
    drafter.proposal = [1] * 9  # 9 tokens to propose: γ 12 and 16 offer no more than γ 10 and cost more
    assert p.plan([Row(0, remaining=1000)], 1).name == "ngram γ10"


def test_chains_past_max_gamma_only_where_their_width_is_nearly_free():
    """Where a forward's time grows with its tokens (a compute-bound CPU: 17 tokens ~2× 9), prompt lookup's chains
    past MAX_GAMMA are not planned even when every proposal would be accepted — a misjudged one costs a whole wide
    verify; where the step reads the same bytes whatever its width they are (the test above)."""
    steep = ForwardCurve([1, 2, 4, 8, 16, 32], 16, 1040, [1.0, 1.1, 1.3, 1.8, 2.9, 5.2], [1.1, 1.2, 1.4, 1.9, 3.0, 5.3])
    drafter = Draftless()
    drafter.proposal = [1] * 16
    p = AutoPolicy([drafter], margin=0.0)
    p.costs = CostModel(CostTable(steep))
    p.acceptance.seed("ngram", 0.0, [1.0] * 16, weight=1e6)
    rows = [Row(0, remaining=1000)]
    assert p.plan(rows, 1).name == "ngram γ8"
    # (scored without the gate, γ 16 would look best: 17 tokens for 3.05 s against 9 for 1.95)
    scores = {c.name: p.score(c, rows, 1)[0] for c in p.candidates}
    assert max(scores, key=scores.get) == "ngram γ16"
    # the same curve made flat past 8 tokens (a memory-bound step): the long chains come back
    flat_past_8 = ForwardCurve(
        [1, 2, 4, 8, 16, 32], 16, 1040, [1.0, 1.1, 1.3, 1.8, 1.9, 2.0], [1.1, 1.2, 1.4, 1.9, 2.0, 2.1]
    )
    q = AutoPolicy([drafter], margin=0.0)
    q.costs = CostModel(CostTable(flat_past_8))
    q.acceptance.seed("ngram", 0.0, [1.0] * 16, weight=1e6)
    assert q.plan(rows, 1).name == "ngram γ16"


def test_self_speculation_drafts_at_its_view_size():
    p = AutoPolicy([SelfDraft()])
    shapes = {c.name: c.shape for c in p.candidates}
    assert shapes["self γ3"].level_tokens == (1, 1, 1) and shapes["self γ3"].draft_context == 64
    assert not shapes["self γ3"].draft_model and shapes["self γ3"].verify == 4


def _tokens(*ids):
    return SimpleNamespace(token_ids=list(ids), spec=None)


def test_a_lagging_draft_model_is_charged_its_catch_up():
    """A draft model's cache misses what other plans commit: switching back first pays a catch-up over those
    tokens, charged at 1 / SWITCH_HORIZON per step — enough here to keep plain decoding; once the draft has
    run (no lag) it wins again. Measured catch-ups correct the prediction."""
    target = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1.0, 1.1, 1.2, 1.4, 1.8], [1.0, 1.1, 1.2, 1.4, 1.8])
    draft = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [0.05, 0.1, 0.2, 0.8, 4.0], [0.05, 0.1, 0.2, 0.8, 4.0])
    p = policy_with(CostTable(target, draft), {"draft": [0.5] * 8, "ngram": [0.0] * 8})
    row = Row(0)
    assert p.plan([row], 1).family == "draft"  # no lag: E 1.5 tokens for 1.2 s beats 1 for 1
    for _ in range(16):  # plain steps: the draft falls 16 tokens behind
        p.observe([row], Plan(AR), [_tokens(7)], None, 1)
    assert p.switch_seconds("draft", [row], 1, 100) == pytest.approx(4.0)
    p.current = AR
    assert p.plan([row], 1).name == "ar"
    # a draft step ran (a probe, say) and caught up: no lag, the draft wins again
    draft_plan = next(c for c in p.candidates if c.name == "draft γ1")
    p.observe([row], Plan(draft_plan), [_tokens(7, 8)], 1.2, 1, catch_up_s=0.4)
    assert p.switch_seconds("draft", [row], 1, 100) == 0.0
    assert p.costs.correction(CATCH_UP, 1) == pytest.approx(0.1)  # measured 0.4 s where the curve said 4
    assert p.plan([row], 1).family == "draft"


def test_plain_decoding_is_probed_at_least_every_max_ar_probe_interval():
    """AR's probes back off like the others' but stop at MAX_AR_PROBE_INTERVAL: its cost stays measured."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])
    p = AutoPolicy([Draftless()], margin=0.0)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    steps = [s for s in range(1, 600) if p.plan([Row(0)], 1).family == "ar"]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert max(gaps) == MAX_AR_PROBE_INTERVAL and gaps[-3:] == [MAX_AR_PROBE_INTERVAL] * 3


def test_a_draftless_drafter_is_planned_by_what_it_proposes_this_step():
    """Before each step the policy asks the draftless drafter what it would propose for each row: with nothing
    anywhere it is no candidate (its step would be a plain one) and is not probed; a row without a proposal
    expects one token from it, whatever its acceptance."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])  # verifies cost what a plain step does
    drafter = Draftless()
    p = AutoPolicy([drafter], margin=0.0)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    assert p.plan([Row(0)], 1).family == "ngram"
    drafter.proposal = []
    plans = [p.plan([Row(0)], 1) for _ in range(3 * PROBE_EVERY)]
    assert all(pl.name == "ar" and not pl.probe for pl in plans)
    drafter.proposal = [1, 1]  # two tokens: a chain past them expects nothing more
    p.plan([Row(0)], 1)  # (planning asks for this step's proposals)
    e = p.expected_by_gamma("ngram", [Row(0)])
    assert e[3] == pytest.approx(e[2]) and e[2] == pytest.approx(1 + 0.9 + 0.81, rel=1e-3)


def test_prefill_bound_steps_decode_plainly():
    """While the prefills that can run now need at least as many steps as any decoding row has tokens left, the
    run ends when they do: speculation could only slow those steps down, so the step is a plain one (and no
    family is probed); with fewer backlog steps than a row's remaining tokens the usual choice comes back."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])  # verifies cost what a plain step does
    p = AutoPolicy([Draftless()], margin=0.0)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)  # speculation wins by far
    rows = [Row(0, remaining=30), Row(1, remaining=200)]
    assert p.plan(rows, 2, prefill_backlog_steps=199).family == "ngram"  # row 1 outlives the backlog
    plans = [p.plan(rows, 2, prefill_backlog_steps=200) for _ in range(3 * PROBE_EVERY)]
    assert all(pl.name == "ar" and not pl.probe for pl in plans)
    assert p.report()["prefill_bound_steps"] == 3 * PROBE_EVERY
    after = [p.plan(rows, 2, prefill_backlog_steps=0) for _ in range(2)]  # (plain decoding's probe fell due)
    assert [pl.family for pl in after if not pl.probe][0] == "ngram"


def test_rows_the_queued_prefills_will_outlast_decode_plainly():
    """A queued prefill that is sure to decode D tokens once done ends the run no sooner than backlog + D steps
    from now: rows with no more than that left decode plainly though each outlives the backlog itself; a row
    with more than that left brings speculation back, as does a backlog that may stop early (D = 0)."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])
    p = AutoPolicy([Draftless()], margin=0.0)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    rows = [Row(0, remaining=120), Row(1, remaining=250)]
    plans = [p.plan(rows, 2, prefill_backlog_steps=50, backlog_decodes=200) for _ in range(3 * PROBE_EVERY)]
    assert all(pl.name == "ar" and not pl.probe for pl in plans)
    assert p.report()["prefill_bound_steps"] == 3 * PROBE_EVERY
    for backlog, decodes in ((50, 199), (50, 0), (0, 500)):  # row 1's 250 > 249; a backlog that may stop; none
        plans = [p.plan(rows, 2, prefill_backlog_steps=backlog, backlog_decodes=decodes) for _ in range(2)]
        assert [pl.family for pl in plans if not pl.probe][0] == "ngram"  # (plain decoding's probe may fall due)


@pytest.mark.parametrize("seed", range(4))
def test_expected_tokens_equal_each_rows_chain_averaged(seed):
    """E(γ) over the rows at once equals each row's own chain expectation (its rates, its offer: a draftless
    proposal's length, its remaining tokens) averaged over the rows — after random records and seeds, with rows at
    two temperatures, rows with and without counts of their own, and requests leaving."""
    rng = random.Random(seed)
    p = AutoPolicy([ModelDraft(), Draftless()], margin=0.0)
    p.costs = CostModel(table(rng))
    rows = [
        Row(i, remaining=rng.randrange(1, 20), params=SamplingParams(temperature=rng.choice([0.0, 0.7])))
        for i in range(7)
    ]
    for _ in range(40):
        family = rng.choice(["draft", "ngram"])
        if rng.random() < 0.8:
            offered = rng.randrange(1, 9)
            p.acceptance.record(family, rng.randrange(9), rng.choice([0.0, 0.7]), rng.randrange(offered + 1), offered)
        else:
            p.acceptance.seed(
                family, rng.choice([0.0, 0.7]), [rng.random() for _ in range(8)], weight=rng.uniform(1, 9)
            )
        if rng.random() < 0.1:
            p.forget(rng.randrange(9))
        proposals = [rng.randrange(0, 20) for _ in rows]
        p._proposing = {"ngram": proposals}
        for family, depth in p.depth.items():
            want = []
            for gamma in range(depth + 1):
                per_row = []
                for i, r in enumerate(rows):
                    offer = min(gamma, r.remaining - 1, proposals[i] if family == "ngram" else gamma)
                    per_row.append(
                        expected_chain_tokens(p.acceptance.rates(family, r.slot, r.params.temperature), offer)
                    )
                want.append(sum(per_row) / len(rows))
            assert p.expected_by_gamma(family, rows) == pytest.approx(want, rel=1e-12)
            for i, r in enumerate(rows):  # one row (its own path, batch 1) == the array path over it, exactly
                p._proposing = {"ngram": [proposals[i]]}
                one = p.expected_by_gamma(family, [r])
                p._proposing = {"ngram": [proposals[i]] * 2}
                assert one == p.expected_by_gamma(family, [r, r])
            p._proposing = {"ngram": proposals}


def test_a_draft_model_probe_is_held_to_the_probe_budget():
    """After its first probe, a draft model is probed again only when the probe's predicted loss — its step and
    its whole catch-up, less what its expected tokens are worth at the chosen plan's rate — is within
    PROBE_BUDGET of the seconds planned since it last ran: a long catch-up postpones the probe past its step
    interval, yet it comes (never permanently wrong); plain decoding's probes are never held back."""
    target = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1.0, 1.1, 1.2, 1.4, 1.8], [1.0, 1.1, 1.2, 1.4, 1.8])
    # a draft forward costs ≥ 2 s; its catch-up over L > 16 missed tokens 2.4 + 0.025 (L - 16) s
    draft = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [2.0, 2.05, 2.1, 2.2, 2.4], [2.0, 2.05, 2.1, 2.2, 2.4])
    p = policy_with(CostTable(target, draft), {"draft": [0.3] * 8, "ngram": [0.0] * 8})
    row = Row(0)
    draft_steps = []
    for step in range(1, 600):
        plan = p.plan([row], 1)
        if plan.family == "draft":
            draft_steps.append(step)
        assert plan.family == "ar" or plan.probe
        p.observe([row], plan, [_tokens(7, 8) if plan.family == "draft" else _tokens(7)], None, 1)
    assert draft_steps[0] in (PROBE_EVERY, PROBE_EVERY + 1)  # the first probe is free
    # then: loss ≈ 3.15 + 2.4 + 0.025 (L - 16) - 1.3 s ≤ 0.05 × L plain 1-s steps → L ≥ ~154, not the interval 32
    gaps = [b - a for a, b in zip(draft_steps, draft_steps[1:])]
    assert len(gaps) >= 2 and all(150 <= g <= 160 for g in gaps), gaps


def test_a_one_step_interlude_charges_a_switch_in_full():
    """When the running draftless drafter has nothing to propose for one step, a lagging draft model would pay
    its whole catch-up for that step alone: it is charged in full (plain decoding wins the interlude), where
    spread over SWITCH_HORIZON steps it would have looked cheap."""
    target = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1.0, 1.1, 1.2, 1.4, 1.8], [1.0, 1.1, 1.2, 1.4, 1.8])
    draft = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [0.05, 0.1, 0.2, 0.4, 0.8], [0.05, 0.1, 0.2, 0.4, 0.8])
    drafter = Draftless()
    p = AutoPolicy([ModelDraft(), drafter], margin=0.0)
    p.costs = CostModel(CostTable(target, draft))
    p.acceptance.seed("draft", 0.0, [0.8] * 8, weight=1e6)
    p.acceptance.seed("ngram", 0.0, [0.99] * 8, weight=1e6)
    row = Row(0)
    plan = p.plan([row], 1)
    assert plan.family == "ngram"
    for _ in range(8):  # prompt lookup commits 64 tokens: the draft model lags by 64 (catch-up ~3.2 s)
        p.observe([row], plan, [_tokens(*([7] * 8))], None, 1)
    drafter.proposal = []
    assert p.plan([row], 1).name == "ar"
    # the same scores spread over SWITCH_HORIZON steps would have picked the draft model
    rows = [row]
    spread = max((p.score(c, rows, 1, None) for c in p.candidates if c.family == "draft"), key=lambda x: x[0])
    assert spread[0] > p.score(AR, rows, 1)[0]


def test_expected_tokens_follow_what_the_family_achieved():
    """A family whose steps achieve fewer tokens than its acceptance predicts (the winner's curse, correlated
    depths) has its expected surplus scaled by the decayed achieved / expected ratio: a predicted gain that does
    not materialize turns into plain decoding; steps that achieve more raise the ratio (capped) and bring it back.
    With nothing observed the ratio is 1 (the brute-force test above)."""
    # a chain of γ costs 1 + 0.5 γ plain steps, its draft nearly nothing: with α = 0.8 a chain predicts ~1.2×
    target = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1.0, 1.5, 2.5, 4.5, 8.5], [1.0, 1.5, 2.5, 4.5, 8.5])
    draft = ForwardCurve([1, 16], 16, 1040, [1e-3, 1e-3], [1e-3, 1e-3])
    p = policy_with(CostTable(target, draft), {"draft": [0.8] * 8, "ngram": [0.0] * 8})
    row = Row(0, remaining=10_000)
    assert p.plan([row], 1).family == "draft"
    plans = []
    for step in range(90):  # its steps achieve 1.5 tokens on average, far under what it expects
        plan = p.plan([row], 1)
        plans.append(plan)
        p.observe([row], plan, [_tokens(*[7] * (1 + step % 2)) if plan.family == "draft" else _tokens(7)], None, 1)
    low = p.report()["realized"]["draft"]
    assert low < 0.7
    assert all(pl.name == "ar" for pl in plans[-30:] if not pl.probe)
    for _ in range(2000):  # now its steps (the probes) accept every draft: the ratio recovers and it is back
        plan = p.plan([row], 1)
        if not plan.probe and plan.family == "draft":
            break
        p.observe([row], plan, [_tokens(*[7] * plan.candidate.tree.size) if plan.tree else _tokens(7)], None, 1)
    else:
        raise AssertionError("the draft model never came back")
    assert p.report()["realized"]["draft"] > low


def test_a_row_near_its_limit_expects_no_more_than_it_may_emit():
    """A row with k tokens left emits at most k from a step: its expected tokens stop growing past γ = k − 1."""
    p = AutoPolicy([Draftless()], margin=0.0)
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    e = p.expected_by_gamma("ngram", [Row(0, remaining=3)])
    assert e[2] == pytest.approx(1 + 0.9 + 0.81, rel=1e-3) and e[8] == pytest.approx(e[2])


def test_a_plan_not_captured_at_the_bucket_runs_only_where_it_repays_the_capture():
    """With CUDA graphs, a plan that has not run at a batch bucket captures (and compiles) first — about a second on
    an H100, measured by the policy from the steps that captured. The best plan, if not captured, must save more
    than that capture over the tokens the rows still emit, against the best captured plan; otherwise the captured
    one runs. Before any capture was measured the margin rule alone decides."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])  # verifies cost what a plain step does
    p = AutoPolicy([Draftless()], margin=0.0, graphs=True)
    p.costs = CostModel(CostTable(flat))
    p.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    g2 = next(c for c in p.candidates if c.name == "ngram γ2")
    p.current = g2
    p.observe([Row(0)], Plan(g2, expected_tokens=2.71), [_tokens(7, 8, 9)], 1.0, 1, capture_s=5.0)
    p.observe([Row(0)], Plan(AR, expected_tokens=1.0), [_tokens(7)], 1.0, 1, capture_s=3.0)
    assert p.capture_cost == pytest.approx(0.7 * 5.0 + 0.3 * 3.0)  # (a decayed mean)
    # 8 tokens left: γ 7 saves 8 / 2.71 − 8 / 5.3 ≈ 1.4 s < 4.4 s of capture — γ 2 (captured) runs
    assert p.plan([Row(0, remaining=8)], 1).name == "ngram γ2"
    # 1,000 tokens left: γ 8 saves ~200 s — captured
    assert p.plan([Row(0, remaining=1000)], 1).name == "ngram γ8"
    # without graphs nothing is captured: the best runs at once
    q = AutoPolicy([Draftless()], margin=0.0)
    q.costs, q.current, q.capture_cost = CostModel(CostTable(flat)), g2, 4.4
    q.acceptance.seed("ngram", 0.0, [0.9] * 8, weight=1e6)
    assert q.plan([Row(0, remaining=8)], 1).name == "ngram γ7"


def test_a_probe_runs_its_familys_captured_plan_at_the_bucket():
    """A probe measures a family; under CUDA graphs it runs the family's best plan already captured at the bucket
    (no capture for one step), and its best plan only where none is."""
    lin = ForwardCurve([1, 2, 4, 8, 16], 16, 1040, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16])
    p = AutoPolicy([ModelDraft(), Draftless()], margin=0.0, graphs=True)
    p.costs = CostModel(CostTable(lin, lin))
    p.acceptance.seed("draft", 0.0, [0.1] * 8, weight=1e6)
    p.acceptance.seed("ngram", 0.0, [0.0] * 8, weight=1e6)
    p._captured |= {("ar", 1), ("draft γ3", 1)}
    probes = {}
    for _ in range(PROBE_EVERY + 2):
        plan = p.plan([Row(0)], 1)
        if plan.probe:
            probes[plan.family] = plan.name
    assert probes["draft"] == "draft γ3"  # (its best by score is γ 1)
    assert probes["ngram"] == "ngram γ1"  # nothing of ngram's captured at bucket 1: its best


def test_a_draining_burst_is_costed_by_its_live_rows():
    """The last rows of a burst run in the bucket it started in: their steps read 7 rows' context, not 64 — the
    cost model is asked with the live rows, so the tail's cheap steps neither teach a wrong correction for the
    full bucket nor are costed as a full bucket's (an H100 at 64 × 30K: 22 ms a plain step with 64 rows, 3.2 ms
    with 7; the correction learnt from both was 0.18 before)."""
    curve = ForwardCurve([1, 2, 4, 8, 16, 64, 1024], 16, 30016, [1.0] * 7, [2.0] * 7)  # context dominates
    p = AutoPolicy([Draftless()], margin=0.0)
    p.costs = CostModel(CostTable(curve))
    tail = [Row(i, computed=30000) for i in range(7)]
    full = [Row(i, computed=30000) for i in range(64)]
    shape = AR.shape
    for _ in range(30):  # the tail's steps take what the table says for 7 live rows
        p.observe(tail, Plan(AR), [_tokens(7)] * 7, p.costs.raw(shape, 64, 30000, live=7), 64)
    assert p.costs.correction("ar", 64) == pytest.approx(1.0)
    assert p.score(AR, full, 64)[2] == pytest.approx(p.costs.raw(shape, 64, 30000))  # 64 rows' reads
    assert p.score(AR, tail, 64)[2] == pytest.approx(p.costs.raw(shape, 64, 30000, live=7))
    assert p.score(AR, tail, 64)[2] < 0.2 * p.score(AR, full, 64)[2]


def test_the_report_gives_each_plans_measured_steps_per_bucket():
    """`steps_measured`: per plan and batch bucket, the timed steps, their mean milliseconds and the tokens a row
    got — where a run's decoding time went (untimed steps, e.g. a thread-count probe's, are left out) — beside the
    rows they ran on and what the plans predicted (ms, tokens a row); the plan that took the most time first."""
    flat = ForwardCurve([1, 16], 16, 1040, [1.0, 1.0], [1.0, 1.0])
    p = AutoPolicy([Draftless()], margin=0.0)
    p.costs = CostModel(CostTable(flat))
    g2 = next(c for c in p.candidates if c.name == "ngram γ2")
    rows = [Row(0), Row(1)]
    p.observe(rows, Plan(g2, expected_tokens=2.5, predicted_s=0.02), [_tokens(7, 8, 9), _tokens(7)], 0.030, 2)
    p.observe(rows, Plan(g2, expected_tokens=2.0, predicted_s=0.03), [_tokens(7, 8), _tokens(7, 8)], 0.020, 2)
    p.observe(rows, Plan(AR, expected_tokens=1.0, predicted_s=0.008), [_tokens(7), _tokens(7)], 0.010, 2)
    p.observe(rows, Plan(AR), [_tokens(7), _tokens(7)], None, 2)  # (not timed)
    p.observe([Row(0)], Plan(AR), [_tokens(7)], 0.004, 1)  # (a fixed plan: no prediction)
    got = p.report()["steps_measured"]
    assert list(got) == ["ngram γ2@2", "ar@2", "ar@1"]
    assert got["ngram γ2@2"] == {
        "steps": 2, "ms": 25.0, "tokens_per_row": 2.0, "rows": 2.0, "predicted_ms": 25.0,
        "expected_tokens_per_row": 2.25,
    }  # fmt: skip
    assert got["ar@2"] == {
        "steps": 1,
        "ms": 10.0,
        "tokens_per_row": 1.0,
        "rows": 2.0,
        "predicted_ms": 8.0,
        "expected_tokens_per_row": 1.0,
    }
    assert got["ar@1"] == {
        "steps": 1,
        "ms": 4.0,
        "tokens_per_row": 1.0,
        "rows": 1.0,
        "predicted_ms": 0.0,
        "expected_tokens_per_row": 0.0,
    }


def _flat_in_context(rng: random.Random, draft_scale: float | None = None) -> CostTable:
    """A random table whose forwards cost the same at every context (a plan made ahead is costed at the context
    its rows will have after the step; with no slope there it must equal the plan made after)."""

    def one(scale):
        tokens, lo, t = [1, 2, 4, 8, 16], [], scale
        for _ in tokens:
            lo.append(t)
            t *= 1 + rng.uniform(0.0, 0.9)
        return ForwardCurve(tokens, 16, 1040, lo, list(lo))

    return CostTable(one(1.0), one(rng.uniform(0.05, 0.5) if draft_scale is None else draft_scale))


@pytest.mark.parametrize("seed", range(6))
def test_a_plan_made_ahead_equals_the_plan_made_after_the_read_back(seed):
    """With `defer_scoring` (a GPU) the next plan's costs and the model families' expectations are worked out in
    the job the device's step runs beside; planned with them, the next step's plan equals the one planned from
    scratch when nothing changed in between (probes, captures, lags and the draftless proposals included) — and as
    the rows near their end (a row with fewer tokens left than a chain's depth offers fewer drafts)."""
    made = []
    for ahead in (True, False):
        rng = random.Random(seed)
        if seed % 2:
            p = policy_with(_flat_in_context(rng), {"draft": [rng.uniform(0.2, 0.95) for _ in range(8)]})
        else:  # (the draft model's long chains win: its rows' last steps offer fewer drafts)
            p = policy_with(_flat_in_context(rng, draft_scale=0.01), {"draft": [0.97] * 8})
        p.acceptance.seed("ngram", 0.0, [rng.uniform(0.0, 0.95) for _ in range(16)], weight=1e6)
        p.drafters[1].proposal = [1] * rng.choice([3, 8, 16])
        p.defer_scoring, p.graphs = True, rng.random() < 0.5
        p._lag["draft"] = {0: rng.randrange(0, 40)}
        n = rng.choice([1, 2, 3])
        rows = [Row(slot=i, computed=rng.randrange(20, 900), remaining=rng.randrange(12, 50)) for i in range(n)]
        bucket = 4 if len(rows) > 2 else len(rows)
        plans = []
        for _ in range(40):  # (past PROBE_EVERY: probes fall due)
            plans.append(p.plan(rows, bucket))
            job = p.take_deferred()
            assert job is not None
            job()
            if not ahead:
                p._ahead = None
            for r in rows:  # (a token a step: the rows near their ends)
                r.remaining = max(r.remaining - 1, 1)
        made.append([(pl.name, pl.probe, pl.expected_tokens, pl.predicted_s) for pl in plans])
        assert p.ahead_plans == (39 if ahead else 0)
    assert made[0] == made[1]


def test_a_plan_made_ahead_is_dropped_for_other_rows():
    """Made for the rows of the step it ran beside: a row leaving (its slot may take another request), other
    rows or another bucket → the next plan starts afresh."""
    rng = random.Random(0)
    p = policy_with(_flat_in_context(rng), {"draft": [0.8] * 8, "ngram": [0.5] * 16})
    p.defer_scoring = True

    def planned_ahead(rows, bucket, before=None):
        p.plan([Row(0), Row(1)], 2)
        p.take_deferred()()
        if before is not None:
            before()
        used = p.ahead_plans
        p.plan(rows, bucket)
        p.take_deferred()()
        return p.ahead_plans > used

    assert planned_ahead([Row(0), Row(1)], 2)
    assert not planned_ahead([Row(0), Row(1)], 2, before=lambda: p.forget(1))
    assert not planned_ahead([Row(0), Row(2)], 2)
    assert not planned_ahead([Row(0), Row(1)], 4)
    assert planned_ahead([Row(0), Row(1, remaining=2)], 2)  # (its expectations afresh: the test above)
