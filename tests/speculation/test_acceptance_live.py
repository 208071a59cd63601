"""Live acceptance (redwood.speculation.acceptance_live): the per-depth counts, their blending per request, and
the shadow scoring of a draftless drafter against the tokens rows emit."""

from __future__ import annotations

import pytest

from redwood.speculation.acceptance_live import (
    DepthRates,
    LiveAcceptance,
    ShadowScorer,
    expected_chain_tokens,
    temperature_bucket,
)


def test_expected_chain_tokens():
    assert expected_chain_tokens([0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_chain_tokens([1.0, 0.0], 4) == pytest.approx(2.0)
    assert expected_chain_tokens([0.9], 0) == 1.0


def test_depth_rates_count_reached_and_accepted_depths():
    r = DepthRates(4, prior=0.5, prior_weight=0.0, decay=1.0)
    r.record(accepted=2, offered=4)  # depths 1, 2 accepted, depth 3 reached and rejected, depth 4 unreached
    r.record(accepted=4, offered=4)
    assert r.reached == [2, 2, 2, 1] and r.hits == [2, 2, 1, 1]
    assert r.rates() == [1.0, 1.0, 0.5, 1.0]
    r.record(accepted=0, offered=2)
    assert r.reached == [3, 2, 2, 1] and r.hits == [2, 2, 1, 1]


def test_decay_forgets_old_steps():
    rates = []
    for decay in (0.5, 1.0):
        r = DepthRates(1, prior=0.5, prior_weight=1.0, decay=decay)
        for accepted in [1] * 20 + [0] * 20:
            r.record(accepted, 1)
        rates.append(r.rates()[0])
    # decayed: ~2 effective steps, all misses, against the prior's one → 0.5 / 3; undecayed: 20.5 / 41
    assert rates[0] == pytest.approx(0.5 / 3, rel=1e-3) and rates[1] == pytest.approx(0.5)


def test_rows_are_shrunk_toward_their_drafter_and_forgotten_on_leaving():
    acc = LiveAcceptance(2, priors={"d": 0.5})
    for _ in range(200):
        acc.record("d", slot=0, temperature=0.0, accepted=2, offered=2)
    for _ in range(40):
        acc.record("d", slot=1, temperature=0.0, accepted=0, offered=2)
    global_rate = acc.overall("d", 0.0)[0]
    assert acc.rates("d", 1, 0.0)[0] < 0.2 < global_rate  # its own collapse shows
    assert acc.rates("d", 0, 0.0)[0] > 0.9
    acc.forget_row(1)
    assert acc.rates("d", 1, 0.0) == acc.overall("d", 0.0)
    # another temperature bucket starts from this one's rates worth BORROW_WEIGHT reaches (not the flat prior)
    assert acc.overall("d", 0.7) == pytest.approx(acc.overall("d", 0.0))
    acc.record("d", slot=2, temperature=0.7, accepted=0, offered=2)  # its own counts then move it fast
    assert acc.overall("d", 0.7)[0] < acc.overall("d", 0.0)[0] * 0.8
    assert LiveAcceptance(2, priors={"d": 0.5}).overall("d", 0.7) == [0.5, 0.5]  # nothing known: the prior
    assert temperature_bucket(0) == 0 and temperature_bucket(0.3) == 1 and temperature_bucket(0.7) == 2
    assert temperature_bucket(1.5) == 3


class Proposer:
    def __init__(self, proposals):
        self.proposals = proposals

    def shadow_propose(self, slot, history, k):
        return self.proposals.pop(0)[:k]


def test_shadow_scoring_follows_a_proposal_across_plain_steps():
    acc = LiveAcceptance(4)
    s = ShadowScorer("ngram", Proposer([[5, 6, 7, 8], [6, 7], [9, 9], [1, 2], []]), acc, 4)
    t = acc._table("ngram", 0)
    s.before(0, [1], 0.0)  # [5, 6, 7, 8]
    s.after(0, [5])  # an AR step: matched so far — depth 1 counts as accepted now, the proposal stays live
    assert t.records == 1 and s.scored == 0 and t.hits[:2] == pytest.approx([1, 0]) and t.reached[0] == 1
    s.before(0, [1, 5], 0.0)  # a new proposal every step: [6, 7] is live beside the first
    s.after(0, [6])
    assert t.records == 2 and s.scored == 0
    s.before(0, [1, 5, 6], 0.0)  # [9, 9]
    s.after(0, [9])  # the first two miss at their third and second token; the third matched its first
    assert t.records == 3 and s.scored == 2
    assert t.hits[:3] == pytest.approx([3, 1, 0], abs=0.03) and t.reached[:3] == pytest.approx([3, 2, 1], abs=0.03)
    s.before(0, [1, 5, 6, 9], 0.0)  # [1, 2]
    s.after(0, [9, 1, 2, 3])  # a speculative step: [9, 9] misses at 2; [1, 2] — offered after the 9 — ...
    assert s.scored == 4  # ... does not see the 9 as its own: it compares from its start, and misses at 1
    assert s.before(0, [1], 0.0) == 0  # nothing to propose: said so (the policy plans around it) ...
    s.after(0, [4])
    assert t.records == 4 and s.scored == 4  # ... and not scored: the rates are acceptance given a proposal


def test_every_step_adds_a_score_once_proposals_resolve():
    """Steady state under plans that emit one token a step: one proposal settles per step (not one per
    proposal length)."""

    class Periodic:
        def shadow_propose(self, slot, history, k):
            return [(len(history) + j) % 3 for j in range(k)]  # the true continuation, always

    acc = LiveAcceptance(4)
    s = ShadowScorer("ngram", Periodic(), acc, 4)
    history = [0]
    for _ in range(20):
        s.before(0, history, 0.0)
        s.after(0, [len(history) % 3])
        history.append(len(history) % 3)
    assert s.scored >= 16  # each proposal lives 4 steps, then is scored: all but the last few
    assert acc.overall("ngram", 0.0)[3] > 0.85


def test_a_record_refreshes_only_its_own_tables_rates():
    """Each (drafter, temperature bucket)'s rates are cached until that table changes: a record of one drafter
    or bucket leaves the others' cached rates as they are, and its own are recomputed."""
    live = LiveAcceptance(4)
    a_t0, b_t0, a_t1 = live.overall("a", 0.0), live.overall("b", 0.0), live.overall("a", 0.7)
    live.record("b", 0, 0.0, 2, 4)
    assert live.overall("a", 0.0) is a_t0 and live.overall("a", 0.7) is a_t1
    assert live.overall("b", 0.0) is not b_t0 and live.overall("b", 0.0)[0] > b_t0[0]
    live.seed("a", 0.7, [0.9] * 4)
    assert live.overall("a", 0.0) is a_t0 and live.overall("a", 0.7) == pytest.approx(
        [0.9 * 16 / 18 + 0.5 * 2 / 18] * 4
    )


@pytest.mark.parametrize("seed", range(5))
def test_scoring_a_step_after_the_next_proposal_was_asked_counts_the_same(seed):
    """A step's scoring handed over (`take`) and settled after the next step's proposal was asked for — as the
    policy defers it on a GPU — ends with the same counts as scoring each step before the next proposal."""
    import random

    rng = random.Random(seed)
    steps = []
    for _ in range(30):
        proposal = [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
        emitted = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
        steps.append((proposal, emitted))

    def run(deferred: bool) -> LiveAcceptance:
        acc = LiveAcceptance(6)
        s = ShadowScorer("ngram", Proposer([list(p) for p, _ in steps]), acc, 6)
        handed = None
        for i, (_, emitted) in enumerate(steps):
            s.before(0, [1] * (i + 1), 0.7)
            if handed is not None:
                s.settle(0, *handed)
            handed = (s.take(0), emitted)
            if not deferred:
                s.settle(0, *handed)
                handed = None
        if handed is not None:
            s.settle(0, *handed)
        return acc

    now, later = run(False), run(True)
    assert later.snapshot() == now.snapshot() and later.rates("ngram", 0, 0.7) == pytest.approx(
        now.rates("ngram", 0, 0.7)
    )
