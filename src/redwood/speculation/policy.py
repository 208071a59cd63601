"""The speculation policy: what each decoding step runs — plain decoding, or which drafter with which tree.

`FixedPolicy` is what the user pinned (`--gamma 3`, a `--tree`, or no speculation): the same plan every step.

`AutoPolicy` (`--speculative auto`, `SpeculativeConfig(policy="auto")`) plans every step for the batch it
runs. Candidates: plain decoding ("ar") and, for every drafter it was given (a draft model or
self-speculation, and a draftless drafter, which costs no draft forward), chains of γ = 1 … MAX_GAMMA — a
draftless drafter's up to γ = 16 (`DRAFTLESS_GAMMAS`: its levels cost no forward). For each it predicts

    tokens per second = Σ_rows E_row[tokens per step] / predicted step seconds

with E from live acceptance (`acceptance_live`: each row's own, shrunk toward its drafter's at its
temperature; 1 for "ar") and the step time from the cost model (`costs`: a calibrated table of forward
times, corrected online from the steps the engine times). It runs the best, with hysteresis: the current
plan is kept unless another is better by `margin` (on CUDA a plan whose graph is not captured yet needs
`capture_margin`), so plans — and CUDA graphs — do not flap on noise.

A CUDA graph is captured the first time a plan runs at a batch bucket, and with it Triton compiles the kernels for
its new shapes: about a second each on an H100 (a `bench serve` ramp over 16K prompts spent 8 of a level's 23 s
capturing, `docs/perf/auto-policy.md` item 20), which no step timing shows. The policy measures that cost
(`capture_cost`, a decayed mean of the captures' seconds) and pays it only where it is repaid: the best plan, if not
captured at this bucket, must save more than one capture over the tokens its rows still have to emit, against the
best plan that is captured; a probe runs its family's best captured plan at the bucket (a probe measures a family,
it need not explore a new γ), and a probe that would capture counts the capture in its budget.

Never permanently wrong: a family (ar, or a drafter) that is not chosen is *probed* — run for one step — after
`PROBE_EVERY` steps, then after twice as many each time it still loses (up to `MAX_PROBE_INTERVAL`;
`MAX_AR_PROBE_INTERVAL` for plain decoding, whose probes are cheap and whose cost is the yardstick), so its cost
and acceptance stay measured while the text changes; its probes count in the run's time, and after a drafter's
first probe they are held to `PROBE_BUDGET` of it (a draft model's probe pays its whole catch-up). Draftless drafters
are also scored for free on every step (`ShadowScorer`), so their acceptance never goes stale.

Expected tokens are corrected by what each family's steps achieved (`Realized`): the planner runs a plan when
its estimate is high, so its steps achieve less than estimated on average (the winner's curse), and per-depth
rates multiplied as if independent drift from the joint chance. Each family's expected surplus (tokens beyond the
one a plain step emits) is scaled by the decayed ratio of achieved to expected surplus over its recent steps. On
a 2-core CPU at batch 4 (code editing, T 0.7) prompt lookup at γ 3 expected 3.58 tokens a row and achieved
3.40: the +2% it was predicted over plain decoding was −8%.

A draft model's KV is written only on its own steps: after steps of another plan its cache lags the target's,
and the executor catches it up (one draft forward over the missed tokens) before its next step. The policy
counts the tokens each row's draft cache missed, predicts that catch-up (the draft's calibrated curve,
corrected by the catch-ups measured) and charges a switch to the draft model 1 / SWITCH_HORIZON of it per
step — on chat at T 0.7, where the draft model and plain decoding are within a few percent, flipping between
them without that charge spent a fifth of the run catching up. The catch-up is not part of the draft plan's
own step cost (it is a switch's, not the plan's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from redwood.errors import ConfigError
from redwood.speculation.acceptance_live import LiveAcceptance, ShadowScorer
from redwood.speculation.costs import CostModel, StepShape
from redwood.speculation.trees import Tree

MAX_GAMMA = 8  # a draft model's or self-speculation's longest chain: each level is a draft forward
# A draftless drafter's chains (`gammas_of`): its levels cost no draft forward, only verify width — which at a large
# batch over long contexts costs little, the step reading every row's KV whatever its width. In MagicDec's regime
# (64 × 30,720, an H100, session 31) the policy ran prompt lookup at the old cap, γ 8, on 55% of its steps, the
# rates at depths 6–8 still 0.89–0.96. Sparse past 8: each γ a plan runs is a CUDA graph per batch bucket.
DRAFTLESS_GAMMAS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
# ... planned only where that width is nearly free (`AutoPolicy._long_chains_gated`): each level past MAX_GAMMA may
# add at most 1 / LONG_CHAIN_LEVEL_COST of the γ-MAX_GAMMA step's predicted time (γ 16: ≤ 1.25×). Without this gate,
# on the 2-core CPU (compute-bound: 17 tokens cost ~2× 9) auto at batch 1 on code editing ran γ 10-16 on 6-18% of
# its steps and fell from 1.03-1.06× fixed prompt lookup to 0.93-1.01× (one run after the other, session 34).
LONG_CHAIN_LEVEL_COST = 32
LONGEST_GAMMA = max(MAX_GAMMA, *DRAFTLESS_GAMMAS)  # the longest chain a plan may run (sizes the KV lookahead)
PROBE_EVERY = 16
MAX_PROBE_INTERVAL = 512
# Plain decoding's probes stop doubling here: they cost little (one step without speculation's gain) and keep
# AR's cost current — the yardstick "never slower than plain decoding" is measured against.
MAX_AR_PROBE_INTERVAL = 64
# A drafter's probes after its first are also held to this share of the run: a probe's predicted loss (its step
# and a lagging draft model's whole catch-up, less the time its expected tokens are worth at the best plan's
# rate) must not exceed PROBE_BUDGET × the predicted seconds since the family last ran. On a 2-core CPU a draft
# model's probe after 50 tokens of prompt lookup costs ~0.3 s (mostly catch-up): unbudgeted, two probes and one
# interlude spent a fifth of a 3-second code-editing request (auto 0.93× fixed prompt lookup).
PROBE_BUDGET = 0.05
MARGIN = 0.03
CAPTURE_MARGIN = 0.10
CAPTURE_DECAY = 0.7  # the old mean's weight at each capture measured (`AutoPolicy.capture_cost`)
# A switch to a draft model whose cache lags (other plans ran) first pays its catch-up: that cost is spread
# over this many steps of the new plan when comparing (a plan, once chosen, is kept for a while — hysteresis).
SWITCH_HORIZON = 4
# The realized-surplus correction: the old sums keep REALIZED_DECAY at each step of the family; REALIZED_PRIOR
# tokens of surplus at ratio 1 start both sums (a first step moves the ratio part of the way); the ratio stays
# within REALIZED_RANGE (a run of unlucky steps must not rule a family out for good: its probes measure it again).
REALIZED_DECAY = 0.95
REALIZED_PRIOR = 8.0
REALIZED_RANGE = (0.5, 1.25)
PRIORS = {"draft": 0.6, "self": 0.6}  # first guesses of α before any step (draftless: scored from step 1)


@dataclass(frozen=True)
class Candidate:
    """One plan: `family` "ar" (drafter and tree None) or a drafter's name, its tree, what its step runs."""

    family: str
    drafter: object | None
    tree: Tree | None
    shape: StepShape

    @property
    def name(self) -> str:
        if self.tree is None:
            return self.family
        if self.tree.is_chain:
            return f"{self.family} γ{self.tree.size - 1}"
        return f"{self.family} tree{self.tree.size}"


AR = Candidate("ar", None, None, StepShape())


@dataclass
class Plan:
    """A step's plan: the candidate, whether it is a probe, and what the policy expected of it (tokens per
    row and seconds; 0 when the policy does not predict — a fixed plan)."""

    candidate: Candidate
    probe: bool = False
    expected_tokens: float = 0.0
    predicted_s: float = 0.0

    drafter = property(lambda self: self.candidate.drafter)
    tree = property(lambda self: self.candidate.tree)
    family = property(lambda self: self.candidate.family)
    name = property(lambda self: self.candidate.name)


def family_of(drafter) -> str:
    return getattr(drafter, "family", type(drafter).__name__)


def gammas_of(drafter) -> tuple[int, ...]:
    """The chain lengths the automatic policy plans for `drafter` (see DRAFTLESS_GAMMAS)."""
    return DRAFTLESS_GAMMAS if getattr(drafter, "needs_history", False) else tuple(range(1, MAX_GAMMA + 1))


def step_shape(drafter, tree: Tree) -> StepShape:
    """What one step of `drafter` over a chain `tree` runs (see `costs.StepShape`)."""
    gamma = tree.size - 1
    if getattr(drafter, "needs_history", False):  # draftless: no draft forward
        return StepShape(verify=tree.size)
    reads = drafter.policy.reads()
    if drafter.standalone:  # the lead token (prev) is re-fed with the root
        return StepShape(tree.size, (2,) + (1,) * (gamma - 1), draft_model=True, draft_context=reads)
    return StepShape(tree.size, (1,) * gamma, draft_model=False, draft_context=reads)


class FixedPolicy:
    """The same plan every step: `drafter` over `tree`, or plain decoding (both None)."""

    auto = False

    def __init__(self, drafter=None, tree: Tree | None = None):
        if drafter is None:
            self._plan = Plan(AR)
        else:
            # (a fixed plan is never costed: its shape only names the verify width)
            self._plan = Plan(Candidate(family_of(drafter), drafter, tree, StepShape(tree.size)))
        self.drafters = [] if drafter is None else [drafter]
        self.max_tree_size = 1 if tree is None else tree.size

    def plan(self, rows, bucket: int, prefill_backlog_steps: int = 0, backlog_decodes: int = 0) -> Plan:
        return self._plan

    def observe(
        self,
        rows,
        ran: Plan,
        tokens,
        seconds: float | None,
        bucket: int,
        catch_up_s: float = 0.0,
        capture_s: float = 0.0,
    ) -> None:
        pass  # (nothing to learn: the plan never changes; SpecStats counts the steps)

    def take_deferred(self) -> None:
        return None  # (no host work of its own to place in a step)

    def forget(self, slot: int) -> None:
        pass


@dataclass
class Realized:
    """A family's decayed sums of expected and achieved surplus tokens per row (beyond the one a plain step emits)
    over the steps it ran → `ratio`, the factor its expected surplus is scaled by."""

    expected: float = REALIZED_PRIOR
    achieved: float = REALIZED_PRIOR

    @property
    def ratio(self) -> float:
        lo, hi = REALIZED_RANGE
        return min(max(self.achieved / self.expected, lo), hi)

    def observe(self, expected_surplus: float, achieved_surplus: float) -> None:
        self.expected = REALIZED_DECAY * self.expected + expected_surplus
        self.achieved = REALIZED_DECAY * self.achieved + achieved_surplus


@dataclass
class _Probe:
    due: int  # the step at which the family is probed next
    interval: int = PROBE_EVERY
    since_s: float = 0.0  # predicted seconds of the steps planned since the family last ran
    ran: bool = False  # run at least once (its first probe is not budgeted)


@dataclass
class _Ahead:
    """The part of a plan that does not wait on the step before it, worked out while the device runs that step
    (`AutoPolicy._plan_ahead_alongside`): every candidate's predicted step seconds (no switch charge) and the model
    families' expected tokens by γ, for the rows in `slots` at `bucket`."""

    slots: tuple[int, ...]
    bucket: int
    seconds: list[float]  # [len(candidates)]
    expected: dict[str, list[float]]  # model family → E(γ), γ = 0 … its depth (unused for rows near their end)


class AutoPolicy:
    """Plans each step from measured costs and live acceptance (see the module docstring)."""

    auto = True

    def __init__(
        self,
        drafters: list,
        *,
        gammas: tuple[int, ...] | None = None,
        margin: float = MARGIN,
        graphs: bool = False,
    ):
        """gammas: the chain lengths planned for every drafter (None: each its own, `gammas_of`)."""
        if not drafters:
            raise ConfigError("the automatic policy needs at least one drafter to choose from")
        self.drafters = list(drafters)
        self.candidates: list[Candidate] = [AR]
        self.depth: dict[str, int] = {}  # family → its longest chain (the depths its acceptance and E(γ) hold)
        for d in self.drafters:
            for g in gammas_of(d) if gammas is None else gammas:
                tree = Tree.chain(g)
                self.candidates.append(Candidate(family_of(d), d, tree, step_shape(d, tree)))
                self.depth[family_of(d)] = max(self.depth.get(family_of(d), 0), g)
        self.max_tree_size = max(c.tree.size for c in self.candidates if c.tree is not None)
        self.acceptance = LiveAcceptance(max(self.depth.values()), PRIORS, depths=self.depth)
        self.shadows = [
            ShadowScorer(family_of(d), d, self.acceptance, self.depth[family_of(d)])
            for d in self.drafters
            if d.needs_history
        ]
        self.margin, self.graphs = margin, graphs
        self.costs: CostModel | None = None  # set by the engine (a calibration, or the cache's)
        # shadow scoring of a step deferred into the next step, run while the device works on it (the engine sets
        # this on a GPU: ~0.5 ms of Python a step at 64 rows × ~8 tokens off the step's critical path); `_deferred`:
        # that scoring until it runs (`take_deferred` hands it to the step; `_settle` runs it otherwise)
        self._defer = False
        self._deferred: Callable[[], None] | None = None
        # with `defer_scoring`, the next plan's costs and model families' expectations, made in the deferred job
        # (`_plan_ahead_alongside`); None: none, or no longer for these rows (a row left: `forget`)
        self._ahead: _Ahead | None = None
        self.ahead_plans = 0  # plans that used it (reports)
        self.costs_path = None  # where that calibration is cached
        self.current: Candidate = AR
        self._proposing: dict[str, list[int]] = {}  # draftless family → its proposal length per row, this step
        self.steps = 0
        self._probes = {f: _Probe(PROBE_EVERY) for f in {"ar", *(family_of(d) for d in self.drafters)}}
        self._captured: set[tuple] = set()  # (candidate name, bucket) run at least once (graph captured)
        self.capture_cost: float | None = None  # seconds one new plan's captures took (decayed mean; None: none seen)
        self.captures = 0  # steps that captured
        self.counts: dict[str, int] = {}  # plan name → steps run
        # "plan@bucket" → [timed steps, seconds, tokens emitted, row-steps, Σ predicted seconds, Σ expected tokens a
        # row] (the predictions of the steps the plan chose: what a run's choices were made on, beside what came)
        self._timed: dict[str, list] = {}
        self.probes = 0
        self.prefill_bound_steps = 0  # steps planned plainly because queued prefills set the run's end
        self.expected_sum = 0.0  # Σ expected tokens per row over planned steps, and achieved (reports)
        self.achieved_sum = 0.0
        self.expected_steps = 0
        self.realized: dict[str, Realized] = {}  # family → its achieved / expected surplus (see the module doc)
        # the model drafters' families (their own KV cache, written only on their own steps) → slot → tokens
        # committed by other plans since (what a switch back must catch up)
        self._lag: dict[str, dict[int, int]] = {
            family_of(d): {} for d in self.drafters if getattr(d, "standalone", False)
        }

    @property
    def defer_scoring(self) -> bool:
        return self._defer

    @defer_scoring.setter
    def defer_scoring(self, on: bool) -> None:
        # (deferred, the draftless drafters' indexes register a step's tokens in the job too: `_register_pending`)
        self._defer = on
        for s in self.shadows:
            if hasattr(s.drafter, "lazy"):
                s.drafter.lazy = on

    def _register_pending(self, slots) -> None:
        """Register the tokens the rows' draftless indexes appended without registering (`NgramDrafter.lazy`: a
        plan only appends them — registering 64 rows' new n-grams was ~half a 64-row plan's host time — and this
        runs in the job the device's step covers)."""
        for s in self.shadows:
            register = getattr(s.drafter, "register_pending", None)
            if register is not None:
                register(slots)

    # ------------------------------------------------------------------ planning
    def expected_by_gamma(self, family: str, rows) -> list[float]:
        """[E(γ) for γ = 0 … the family's longest chain]: expected tokens per row per step of a chain of γ from
        `family`, averaged over the rows (one pass per row: the running products of its α_d; a draftless drafter's
        row offers only the proposal it has this step — none: 1 token; a row emits at most its `remaining`
        tokens), the surplus over 1 scaled by the family's realized ratio."""
        depth = self.depth[family]
        if not rows:
            return [1.0] * (depth + 1)
        proposing = self._proposing.get(family)
        if len(rows) == 1:  # (one row — batch 1 — in plain Python: the same arithmetic, a third of the time)
            return self._expected_of_row(family, rows[0], depth, None if proposing is None else proposing[0])
        rates = self.acceptance.rates_of_rows(family, [r.slot for r in rows], [r.params.temperature for r in rows])
        # (draftless: its proposal; drafts past a row's limit are never emitted)
        offered = np.maximum(np.minimum(np.array([r.remaining - 1 for r in rows]), depth), 0)
        if proposing is not None:
            offered = np.minimum(offered, np.array(proposing))
        rates[np.arange(depth)[None, :] >= offered[:, None]] = 0.0  # (no more tokens past what is offered)
        # each row's [E(0), …, E(depth)]: 1 + the running sums of the running products of its α_d (left to right,
        # as a loop would add them)
        per_row = np.cumsum(np.concatenate([np.ones((len(rows), 1)), np.cumprod(rates, axis=1)], axis=1), axis=1)
        ratio = self.realized[family].ratio if family in self.realized else 1.0
        return [1.0 + ratio * (m - 1.0) for m in (per_row.sum(axis=0) / len(rows)).tolist()]

    def _expected_of_row(self, family: str, row, depth: int, proposing: int | None) -> list[float]:
        """`expected_by_gamma` of one row, as the array path computes it (the same operations in the same order)."""
        rates = self.acceptance.rates(family, row.slot, row.params.temperature)
        offered = max(min(row.remaining - 1, depth), 0)
        if proposing is not None:
            offered = min(offered, proposing)
        out, run, total = [1.0], 1.0, 1.0
        for d in range(offered):
            run *= rates[d]
            total += run
            out.append(total)
        out += [total] * (depth - offered)
        ratio = self.realized[family].ratio if family in self.realized else 1.0
        return [1.0 + ratio * (m - 1.0) for m in out]

    def switch_seconds(self, family: str, rows, bucket: int, context: int) -> float:
        """The predicted catch-up a step of `family` pays first (0 unless it is a lagging draft model)."""
        lag = self._lag.get(family)
        if not lag:
            return 0.0
        behind = [lag.get(r.slot, 0) for r in rows]
        if not any(behind):
            return 0.0
        return self.costs.catch_up(sum(b > 0 for b in behind), max(behind), bucket, context)

    def score(
        self,
        cand: Candidate,
        rows,
        bucket: int,
        expected: dict | None = None,
        horizon: int = SWITCH_HORIZON,
        context: float | None = None,
    ) -> tuple[float, float, float]:
        """→ (tokens per second, expected tokens per row, predicted seconds) of `cand` for these rows; the
        seconds include 1 / horizon of a lagging draft model's catch-up. context: the rows' mean (given by a
        caller scoring many candidates: a sum over 64 rows per candidate was a share of the plan's time)."""
        if context is None:
            context = sum(r.computed for r in rows) / len(rows)
        seconds = self.costs.predict(cand.family, cand.shape, bucket, bucket, int(context), live=len(rows))
        seconds += self.switch_seconds(cand.family, rows, bucket, int(context)) / horizon
        if cand.tree is None:
            e = 1.0
        else:
            by_gamma = expected[cand.family] if expected is not None else self.expected_by_gamma(cand.family, rows)
            e = by_gamma[cand.tree.size - 1]
        return e * len(rows) / seconds, e, seconds

    def plan(self, rows, bucket: int, prefill_backlog_steps: int = 0, backlog_decodes: int = 0) -> Plan:
        """The plan of the next step over decoding `rows` (each with .slot, .params, .computed, .token_ids,
        .remaining) in a batch bucket of `bucket` slots; prefill_backlog_steps: steps the prefills that can
        proceed now still need (`Scheduler.prefill_backlog_steps`); backlog_decodes: tokens each of those
        requests is sure to decode afterwards (`Scheduler.backlog_then_decodes`)."""
        if self.costs is None:
            raise RuntimeError("the automatic policy has no cost model yet (the engine calibrates it first)")
        self.steps += 1  # (a deferred scoring of the last step runs after this plan: it was made without it)
        bound = self._prefill_bound(rows, prefill_backlog_steps, backlog_decodes)
        # draftless drafters: what each row's proposal is this step (0 tokens: none — a step of that drafter
        # decodes the row plainly, and with no row proposing it would be a plain step: not a candidate now)
        self._proposing = {}
        if bound and self.defer_scoring and self.shadows:
            self._ask_alongside(rows)  # (a plain step needs no proposal now: asked for while the device works)
        else:
            for s in self.shadows:
                s.drafter.grow([(r.slot, r.token_ids) for r in rows])  # (the rows' new tokens indexed at once)
                self._proposing[s.name] = [s.before(r.slot, r.token_ids, r.params.temperature) for r in rows]
        if bound:
            self.prefill_bound_steps += 1
            return Plan(AR, expected_tokens=1.0)
        idle = {f for f, lens in self._proposing.items() if not any(lens)}
        # The running plan's draftless drafter has nothing to propose this step: an interlude of one step, most
        # likely (its proposals come back with the next tokens) — a lagging draft model would pay its whole
        # catch-up for that one step, so it is charged in full, not spread over SWITCH_HORIZON steps.
        horizon = 1 if self.current.family in idle else SWITCH_HORIZON
        context = sum(r.computed for r in rows) / len(rows)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.bucket != bucket or ahead.slots != tuple(r.slot for r in rows)):
            ahead = None
        if ahead is None:
            seconds, expected = self._costs_and_expectations(rows, bucket, context)
        else:  # (made while the device ran the last step: only the draftless drafters' proposals are new)
            self.ahead_plans += 1
            seconds, expected = ahead.seconds, dict(ahead.expected)
            near_end = any(r.remaining <= self.depth[f] for r in rows for f in ahead.expected)
            for f in {c.family for c in self.candidates if c.tree} if near_end else self._proposing:
                expected[f] = self.expected_by_gamma(f, rows)  # (a row near its end offers fewer drafts: now)
        switch = {f: self.switch_seconds(f, rows, bucket, int(context)) / horizon for f in self._lag}
        scored = []
        for c, s in zip(self.candidates, seconds):
            if c.family in idle:
                continue
            s += switch.get(c.family, 0.0)
            e = 1.0 if c.tree is None else expected[c.family][c.tree.size - 1]
            scored.append(((e * len(rows) / s, e, s), c))
        scored = _long_chains_gated(scored)
        best_of: dict[str, tuple] = {}
        for sc, c in scored:
            if c.family not in best_of or sc[0] > best_of[c.family][0][0]:
                best_of[c.family] = (sc, c)
        (best_rate, best_e, best_s), best = self._worth_capturing(
            max(best_of.values(), key=lambda x: x[0][0]), scored, rows, bucket
        )
        current = next(((sc, c) for sc, c in scored if c == self.current), None)
        chosen, (rate, e, s) = best, (best_rate, best_e, best_s)
        if current is not None and current[1] != best:
            margin = self.margin
            if self._uncaptured(best, bucket):
                margin = max(margin, CAPTURE_MARGIN)
            if best_rate <= current[0][0] * (1 + margin):
                chosen, (rate, e, s) = current[1], current[0]
        self.current = chosen
        for fam, probe in self._probes.items():  # the chosen family is not probed; its clock restarts
            if fam == chosen.family:
                probe.due, probe.interval = self.steps + PROBE_EVERY, PROBE_EVERY
        due = {}  # family → the plan its probe would run (`_probe_candidate`), for the affordable ones due now
        for f, p in self._probes.items():
            if f != chosen.family and p.due <= self.steps and f not in idle:
                probe_plan = self._probe_candidate(f, best_of, scored, bucket)
                if self._affordable(f, probe_plan[1], rows, bucket, rate, expected):
                    due[f] = probe_plan
        plan = Plan(chosen, expected_tokens=e, predicted_s=s)
        if due:
            fam = min(due, key=lambda f: self._probes[f].due)
            probe = self._probes[fam]
            probe.interval = min(2 * probe.interval, MAX_AR_PROBE_INTERVAL if fam == "ar" else MAX_PROBE_INTERVAL)
            probe.due = self.steps + probe.interval
            (_, e, s), cand = due[fam]
            self.probes += 1
            plan = Plan(cand, probe=True, expected_tokens=e, predicted_s=s)
        for fam, probe in self._probes.items():
            if fam == plan.family:
                probe.since_s, probe.ran = 0.0, True
            else:
                probe.since_s += plan.predicted_s
        if self.defer_scoring:
            self._plan_ahead_alongside(rows, bucket, context + plan.expected_tokens)
        return plan

    def _costs_and_expectations(
        self, rows, bucket: int, context: float, families: set[str] | None = None
    ) -> tuple[list[float], dict]:
        """Every candidate's predicted step seconds (no switch charge) and the E(γ) of `families` (default: every
        family with chains) for these rows."""
        live = len(rows)
        seconds = [
            self.costs.predict(c.family, c.shape, bucket, bucket, int(context), live=live) for c in self.candidates
        ]
        if families is None:
            families = {c.family for c in self.candidates if c.tree}
        return seconds, {f: self.expected_by_gamma(f, rows) for f in families}

    def _plan_ahead_alongside(self, rows, bucket: int, context: float) -> None:
        """Append to the job the device's step runs beside (`take_deferred`) the next plan's heavy part: every
        candidate's predicted seconds and the model families' E(γ) (`_Ahead`), for these rows at `context` (their
        mean after this step's expected tokens). The next plan then asks only the draftless drafters' proposals and
        their E(γ) after the read-back. At batch 1 on an H100 host a whole plan took 0.29–0.49 ms of a 1.5–2.5 ms
        step (session 38: auto's host 0.52–0.87 ms a step, AR's 0.14–0.27), the device idle meanwhile. What the
        next plan gets is one step stale: the costs and the model families' acceptance as they were before this
        step's read-back (the draftless drafters' scoring is one step late already, `defer_scoring`)."""
        slots = tuple(r.slot for r in rows)
        before = self._deferred

        def job() -> None:
            if before is not None:
                before()
            self._register_pending(slots)
            draftless = {s.name for s in self.shadows}  # (their E(γ) waits on this step's tokens)
            models = {c.family for c in self.candidates if c.tree is not None and c.family not in draftless}
            self._ahead = _Ahead(slots, bucket, *self._costs_and_expectations(rows, bucket, context, models))

        self._deferred = job

    def _ask_alongside(self, rows) -> None:
        """A prefill-bound step's draftless proposals (still scored: the acceptance the steps after the prefills
        plan with) asked for in the deferred job the engine runs between the step's launches and its read-back,
        after the last step's scoring, instead of before the launches: with 64 rows a step, ~1.2 ms of an H100
        step's host time (its prefill chunk's launches waited on it), over every step of a long prefill phase
        (64 × 8K prompts, 2,048 prefill tokens a step: 252 of the run's 386 steps; auto's first tokens came 23%
        later than AR's). The job sees each row's tokens as they were at this plan."""
        asked = [(r.slot, r.token_ids, len(r.token_ids), r.params.temperature) for r in rows]
        scoring = self._deferred

        def job() -> None:
            if scoring is not None:
                scoring()
            for s in self.shadows:
                # (left untaken — `Executor.execute` planning for itself — `_settle` runs it in `observe`, after the
                # rows' new tokens: each row read as far as it was at the plan)
                histories = [(slot, h if len(h) == n else h[:n]) for slot, h, n, _ in asked]
                s.drafter.grow(histories)
                for (slot, history), (_, _, _, temperature) in zip(histories, asked):
                    s.before(slot, history, temperature)
            self._register_pending([slot for slot, _, _, _ in asked])

        self._deferred = job

    @staticmethod
    def _prefill_bound(rows, backlog_steps: int, backlog_decodes: int) -> bool:
        """Whether queued prefills, not these rows, set when the run ends: the last of them is prefilled after
        `backlog_steps` steps and then decodes at least `backlog_decodes` tokens, at the rate these rows would
        once the prefills are done — so a row that, decoding plainly until then, has no more than that left
        ends no later, whatever it runs now. Speculating on those steps would only make each longer (their
        prefill chunks wait on it: the prefills end later, and with them the run) and drain the rows sooner,
        leaving later steps fewer rows to share the weights' read: plain decoding is the cheapest step.
        Measured on an H100: 64 × 16K prompts, 256 new tokens — auto 0.95× AR with the prefills done 2.2 s
        later (the backlog alone, backlog_decodes 0); 64 × 8K prompts, 256 new tokens at 2,048 prefill tokens
        a step — auto 0.95× AR (repeats 0.88–0.95×), each of its 256 steps that carried a prefill chunk 3.7 ms
        longer than AR's while no decoding row could outlast the rows still prefilling."""
        if backlog_steps <= 0 or not rows:
            return False
        return max(r.remaining for r in rows) <= backlog_steps + backlog_decodes

    def _uncaptured(self, cand: Candidate, bucket: int) -> bool:
        """Whether running `cand` at `bucket` would capture a CUDA graph first (never without graphs)."""
        return self.graphs and (cand.name, bucket) not in self._captured

    def _worth_capturing(self, best: tuple, scored: list, rows, bucket: int) -> tuple:
        """`best` ((rate, e, seconds), candidate), or the best captured candidate when `best` is not captured at
        this bucket and would not repay its capture: the time it saves over the rows' remaining tokens (at the
        two rates) must exceed `capture_cost`. Before any capture was measured, `best` (CAPTURE_MARGIN guards)."""
        if self.capture_cost is None or not self._uncaptured(best[1], bucket):
            return best
        captured = [x for x in scored if not self._uncaptured(x[1], bucket)]
        if not captured:
            return best  # (a new bucket: whatever runs captures)
        alt = max(captured, key=lambda x: x[0][0])
        remaining = sum(max(r.remaining, 1) for r in rows)  # tokens these rows still emit
        saved = remaining / alt[0][0] - remaining / best[0][0]
        return best if saved > self.capture_cost else alt

    def _probe_candidate(self, family: str, best_of: dict, scored: list, bucket: int) -> tuple:
        """The plan a probe of `family` runs: its best captured at this bucket, else its best (which captures)."""
        if self.graphs:
            captured = [x for x in scored if x[1].family == family and not self._uncaptured(x[1], bucket)]
            if captured:
                return max(captured, key=lambda x: x[0][0])
        return best_of[family]

    def _affordable(self, family: str, cand: Candidate, rows, bucket: int, best_rate: float, expected: dict) -> bool:
        """Whether a probe of `family` running `cand` now keeps within PROBE_BUDGET (plain decoding and first
        probes always do); a probe that captures counts the capture."""
        probe = self._probes[family]
        if family == "ar" or not probe.ran:
            return True
        _, e, seconds = self.score(cand, rows, bucket, expected, horizon=1)  # (a probe pays its whole catch-up)
        if self._uncaptured(cand, bucket):
            seconds += self.capture_cost or 0.0
        loss = seconds - e * len(rows) / best_rate
        return loss <= PROBE_BUDGET * probe.since_s

    # ------------------------------------------------------------------ learning
    def observe(
        self,
        rows,
        ran: Plan,
        tokens,
        seconds: float | None,
        bucket: int,
        catch_up_s: float = 0.0,
        capture_s: float = 0.0,
    ) -> None:
        """After a step: `ran` — the plan that ran (plain decoding when its drafter had nothing to propose);
        tokens[i] — `Tokens` of rows[i]; seconds: the step's time without the draft model's catch-up (None:
        not to learn from, e.g. a thread-count probe); catch_up_s: that catch-up's time (0: none ran);
        capture_s: the one-time graph captures (and kernel compiles) the step did first (0: none)."""
        if capture_s > 0:
            self.captures += 1
            old = self.capture_cost
            self.capture_cost = capture_s if old is None else CAPTURE_DECAY * old + (1 - CAPTURE_DECAY) * capture_s
        self._settle()  # (the previous step's scoring: on a GPU done during this step's forward)
        if self.shadows:  # this step's proposals handed over now, scored now or (deferred) during the next step
            handed = [(s, [(r.slot, s.take(r.slot), t.token_ids) for r, t in zip(rows, tokens)]) for s in self.shadows]

            def score() -> None:
                for s, items in handed:
                    for slot, live, emitted in items:
                        s.settle(slot, live, emitted)

            if self.defer_scoring:
                self._deferred = score
            else:
                score()
        cand = ran.candidate
        context = int(sum(r.computed for r in rows) / len(rows)) if rows else 0
        for family, lag in self._lag.items():
            if cand.family == family:
                if catch_up_s > 0 and seconds is not None and self.costs is not None:
                    behind = [lag.get(r.slot, 0) for r in rows]
                    self.costs.observe_catch_up(sum(b > 0 for b in behind), max(behind), bucket, context, catch_up_s)
                for r in rows:
                    lag[r.slot] = 0
            else:
                for r, t in zip(rows, tokens):
                    lag[r.slot] = lag.get(r.slot, 0) + len(t.token_ids)
        self.counts[cand.name] = self.counts.get(cand.name, 0) + 1
        emitted = sum(len(t.token_ids) for t in tokens)  # (the timings' and the expectation's tokens)
        if seconds is not None and rows:  # per plan and bucket (`_timed`)
            timed = self._timed.setdefault(f"{cand.name}@{bucket}", [0, 0.0, 0, 0, 0.0, 0.0])
            timed[0] += 1
            timed[1] += seconds
            timed[2] += emitted
            timed[3] += len(rows)
            timed[4] += ran.predicted_s
            timed[5] += ran.expected_tokens
        self._captured.add((cand.name, bucket))
        if cand.tree is not None and not getattr(cand.drafter, "needs_history", False):
            gamma = cand.tree.size - 1
            for r, t in zip(rows, tokens):
                if t.spec is not None:
                    self.acceptance.record(cand.family, r.slot, r.params.temperature, t.spec[0], gamma)
        if ran.expected_tokens:
            achieved = emitted / max(len(tokens), 1)
            self.expected_steps += 1
            self.expected_sum += ran.expected_tokens
            self.achieved_sum += achieved
            if cand.tree is not None:  # (the plan's expectation was scaled by the ratio: unscale it)
                realized = self.realized.setdefault(cand.family, Realized())
                realized.observe((ran.expected_tokens - 1.0) / realized.ratio, achieved - 1.0)
        if seconds is not None and self.costs is not None and rows:
            self.costs.observe(cand.family, cand.shape, bucket, bucket, context, seconds, live=len(rows))

    def take_deferred(self) -> Callable[[], None] | None:
        """The last step's shadow scoring — and, on a prefill-bound step, that step's draftless proposals
        (`_ask_alongside`) — for the engine to run during the next step while the device works (with
        `defer_scoring`; taken after planning that step, which is then made one step's acceptance late); None when
        there is none. The taker must run it before the next `observe`."""
        job, self._deferred = self._deferred, None
        return job

    def _settle(self) -> None:
        """Run any deferred scoring not handed to a step."""
        job = self.take_deferred()
        if job is not None:
            job()

    def forget(self, slot: int) -> None:
        """A request left `slot`."""
        self._settle()  # (its last step's proposals are scored before its counts go)
        self._ahead = None  # (made for the rows as they were: another request may take the slot)
        self.acceptance.forget_row(slot)
        for s in self.shadows:
            s.forget(slot)
        for lag in self._lag.values():  # (the next request's draft KV is prefilled with its prompt)
            lag.pop(slot, None)

    def report(self) -> dict:
        """Plan counts, probes, expected vs achieved tokens per step, the acceptance the policy holds."""
        self._settle()
        planned = self.expected_steps
        return {
            "plans": dict(sorted(self.counts.items(), key=lambda kv: -kv[1])),
            "probes": self.probes,
            "prefill_bound_steps": self.prefill_bound_steps,
            "planned_ahead": self.ahead_plans,
            "expected_tokens_per_step": round(self.expected_sum / planned, 3) if planned else None,
            "achieved_tokens_per_step": round(self.achieved_sum / planned, 3) if planned else None,
            "acceptance": self.acceptance.snapshot(),
            "realized": {f: round(r.ratio, 3) for f, r in sorted(self.realized.items())},
            "draftless_scored": {s.name: s.scored for s in self.shadows},
            "measured_over_predicted": self.costs.snapshot() if self.costs is not None else {},
            "captures": self.captures,
            "capture_cost_s": None if self.capture_cost is None else round(self.capture_cost, 3),
            # what each plan's steps measured at each batch bucket (the time the costs learn from: drafting, the
            # verify and its one sync, captures and catch-ups left out) and gave a row — where decoding time went —
            # beside what the plan predicted when it chose them (seconds with any switch charge, tokens a row; 0 for
            # a fixed plan) and the rows they ran on
            "steps_measured": {
                key: {
                    "steps": n,
                    "ms": round(1e3 * s / n, 3),
                    "tokens_per_row": round(tok / rs, 3),
                    "rows": round(rs / n, 2),
                    "predicted_ms": round(1e3 * ps / n, 3),
                    "expected_tokens_per_row": round(et / n, 3),
                }
                for key, (n, s, tok, rs, ps, et) in sorted(self._timed.items(), key=lambda kv: -kv[1][1])
            },
        }


def _long_chains_gated(scored: list) -> list:
    """`scored` ((rate, E, seconds), candidate) less the chains past MAX_GAMMA whose extra verify width is not nearly
    free: each level past MAX_GAMMA may add at most 1 / LONG_CHAIN_LEVEL_COST of the family's γ = MAX_GAMMA step's
    predicted seconds. A step bound by reading the weights and the KV (a GPU batch over long contexts) passes; a
    compute-bound one (the CPU) does not, where a long chain's few extra tokens rarely repay it and a misjudged one
    costs a whole wide verify. (Draftless families, the only ones with long chains, pay no switch charge, so their
    scored seconds are the cost model's step alone.)"""
    base = {c.family: sc[2] for sc, c in scored if c.tree is not None and c.tree.size == MAX_GAMMA + 1}
    kept = []
    for sc, c in scored:
        gamma = 0 if c.tree is None else c.tree.size - 1
        if (
            gamma > MAX_GAMMA
            and c.family in base
            and sc[2] > base[c.family] * (1 + (gamma - MAX_GAMMA) / LONG_CHAIN_LEVEL_COST)
        ):
            continue
        kept.append((sc, c))
    return kept
