"""Live acceptance: how often each drafter's d-th draft token is accepted, learnt from the steps as they run.

Terms. A chain step offers draft tokens 1..γ; token d is *reached* when tokens 1..d−1 were accepted, and
then accepted or not. α_d = P(accepted | reached) — the chain form of the acceptance vectors `redwood
acceptance` measures offline. Expected tokens of a chain of γ: 1 + Σ_{d≤γ} α_1 ⋯ α_d (the bonus /
correction token always comes).

`DepthRates` keeps decayed counts (hits and reaches per depth; every record first multiplies the old
counts by `decay`, so the rates follow a request whose text changes character) on top of a prior (a rate and
a weight in pseudo-reaches). `LiveAcceptance` keeps one per (drafter, temperature bucket) and one per
(drafter, batch slot) for the request in it, and blends them: a request's own counts, shrunk toward its
drafter's at its temperature (`ROW_PRIOR` pseudo-reaches) — so a row whose acceptance collapsed plans for
itself, and a new row starts from what the others taught.

`ShadowScorer` scores a draftless drafter for free whether or not it runs: before a step it asks the drafter
what it *would* propose after each row's tokens, and after the step compares that proposal with the tokens
the row actually emitted. For a proposal that is one token per position (a one-hot draft distribution) the
chance that a sampled token equals it is exactly the chance rejection sampling accepts it (p(x) both ways),
so the counts are unbiased at every temperature, and a drafter the policy does not choose keeps being scored.
A step where it has nothing to propose is not scored: its rates are acceptance *given* a proposal, and the
policy, which knows before each step which rows have one, plans around the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from redwood.errors import ConfigError
from redwood.jsonfile import check_format, read_json
from redwood.speculation.trees import acceptance_rows

TEMP_BUCKETS = (0.0, 0.5, 1.0)  # temperature 0 | (0, 0.5] | (0.5, 1] | above
ROW_PRIOR = 4.0
BORROW_WEIGHT = 2.0  # reaches a new temperature bucket's table takes from the drafter's nearest one  # pseudo-reaches a row's own counts are shrunk toward its drafter's with
GLOBAL_DECAY = 0.995
ROW_DECAY = 0.95


def temperature_bucket(t: float) -> int:
    if t <= 0:
        return 0
    for i, edge in enumerate(TEMP_BUCKETS[1:], start=1):
        if t <= edge:
            return i
    return len(TEMP_BUCKETS)


def expected_chain_tokens(rates: list[float], gamma: int) -> float:
    """1 + Σ_{d≤γ} α_1 ⋯ α_d: tokens a chain of γ emits per step on average (depths past the rates reuse
    the last)."""
    total, run = 1.0, 1.0
    for d in range(gamma):
        run *= rates[min(d, len(rates) - 1)]
        total += run
    return total


def chain_rates_from_file(path: str) -> tuple[list[float], float]:
    """A `redwood acceptance` file (``redwood.acceptance/1``) → (α_d per depth for a chain — the rank-1 child's
    acceptance at each depth, its `per_depth` table where present —, the temperature it was measured at)."""
    d = read_json(path, "acceptance")
    check_format(d, "redwood.acceptance/1", str(path))
    if "values" not in d:
        raise ConfigError(f"{path}: missing 'values' (the per-rank acceptance p_1..p_W)")
    try:
        rows = acceptance_rows(SimpleNamespace(values=d["values"], per_depth=d.get("per_depth")))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    t = d.get("temperature")
    return [float(r[0]) for r in rows], 0.0 if t is None else float(t)


@dataclass
class DepthRates:
    depth: int
    prior: float = 0.5
    prior_weight: float = 2.0
    prior_rates: list[float] | None = None  # a prior per depth instead of the flat `prior`
    decay: float = GLOBAL_DECAY
    hits: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    records: int = 0

    def __post_init__(self) -> None:
        self.hits = self.hits or [0.0] * self.depth
        self.reached = self.reached or [0.0] * self.depth

    def record(self, accepted: int, offered: int, start: int = 0) -> None:
        """One verified proposal: `offered` draft tokens, the first `accepted` of them accepted. `start` > 0:
        the rest of a proposal whose first `start` tokens were recorded already (as accepted: a proposal
        scored as its tokens arrive); only a proposal's first record decays the old counts."""
        offered = min(offered, self.depth)
        accepted = min(accepted, offered)
        if start == 0:
            decay = self.decay
            self.hits = [h * decay for h in self.hits]
            self.reached = [n * decay for n in self.reached]
            self.records += 1
        hits, reached = self.hits, self.reached
        for d in range(start, accepted):  # (reached and accepted)
            reached[d] += 1.0
            hits[d] += 1.0
        if accepted < offered and accepted >= start:  # (reached and rejected: the proposal's end)
            reached[accepted] += 1.0

    def rates(self, prior: list[float] | None = None, weight: float | None = None) -> list[float]:
        """α_d per depth: the counts shrunk toward `prior` (default: this table's own flat prior)."""
        w = self.prior_weight if weight is None else weight
        prior = self.prior_rates if prior is None else prior
        if prior is None:
            prior = [self.prior] * self.depth
        return [(h + w * p) / (n + w) for h, n, p in zip(self.hits, self.reached, prior)]

    def seed(self, rates: list[float], weight: float) -> None:
        """Start from known rates (an acceptance file) worth `weight` reaches at each depth."""
        for d in range(self.depth):
            r = rates[min(d, len(rates) - 1)]
            self.hits[d], self.reached[d] = weight * r, weight


class LiveAcceptance:
    """Per (drafter, temperature bucket) and per (drafter, slot) acceptance by depth."""

    def __init__(self, depth: int, priors: dict[str, float] | None = None, depths: dict[str, int] | None = None):
        self.depth = depth  # the depths a drafter's tables hold: `depths`'s entry for it, else this
        self.depths = dict(depths or {})
        self.priors = dict(priors or {})  # drafter → its first guess of α (before any step)
        self._global: dict[tuple[str, int], DepthRates] = {}
        self._rows: dict[tuple[str, int], DepthRates] = {}
        # (drafter, bucket) → its table's rates, until the next record or seed: a plan asks them once per row
        self._overall: dict[tuple[str, int], list[float]] = {}

    def _table(self, drafter: str, bucket: int) -> DepthRates:
        key = (drafter, bucket)
        t = self._global.get(key)
        if t is None:
            t = DepthRates(self.depths.get(drafter, self.depth), prior=self.priors.get(drafter, 0.5))
            # a temperature bucket seen first takes the drafter's nearest bucket with counts as its prior (worth
            # BORROW_WEIGHT reaches), not the flat one: acceptance moves with temperature, not from scratch
            known = [(abs(b - bucket), b) for (d, b), x in self._global.items() if d == drafter and x.records]
            if known:
                t.prior_rates = self._global[(drafter, min(known)[1])].rates()
                t.prior_weight = BORROW_WEIGHT
            self._global[key] = t
        return t

    def seed(self, drafter: str, temperature: float, rates: list[float], weight: float = 16.0) -> None:
        bucket = temperature_bucket(temperature)
        self._overall.pop((drafter, bucket), None)
        self._table(drafter, bucket).seed(rates, weight)

    def record(self, drafter: str, slot: int, temperature: float, accepted: int, offered: int, start: int = 0) -> None:
        bucket = temperature_bucket(temperature)
        self._overall.pop((drafter, bucket), None)  # (only this table changed: the others' rates stay cached)
        self._table(drafter, bucket).record(accepted, offered, start)
        row = self._rows.get((drafter, slot))
        if row is None:
            row = self._rows[(drafter, slot)] = DepthRates(self.depths.get(drafter, self.depth), decay=ROW_DECAY)
        row.record(accepted, offered, start)

    def rates(self, drafter: str, slot: int, temperature: float) -> list[float]:
        """α_d for the request in `slot`: its own counts shrunk toward its drafter's at its temperature."""
        overall = self.overall(drafter, temperature)
        row = self._rows.get((drafter, slot))
        return list(overall) if row is None else row.rates(prior=overall, weight=ROW_PRIOR)

    def rates_of_rows(self, drafter: str, slots: list[int], temperatures: list[float]) -> np.ndarray:
        """[rows, depth] float64: `rates(drafter, slot, temperature)` of each row, in one array operation (a plan
        asks them of 64 rows for every family: one at a time, ~0.3 ms of its ~1 ms at prompt lookup's 16 depths).
        The same arithmetic as `DepthRates.rates`; a row without counts of its own gets its drafter's rates."""
        if not slots:
            return np.zeros((0, self.depths.get(drafter, self.depth)))
        buckets = {t: temperature_bucket(t) for t in set(temperatures)}  # (a batch has a few temperatures)
        by_bucket = {b: self.overall(drafter, t) for t, b in buckets.items()}
        if len(by_bucket) == 1:
            prior = np.array(next(iter(by_bucket.values())), dtype=np.float64)  # [depth], broadcast over the rows
        else:
            prior = np.array([by_bucket[buckets[t]] for t in temperatures], dtype=np.float64)
        zeros = [0.0] * prior.shape[-1]
        tables = [self._rows.get((drafter, s)) for s in slots]
        hits = np.array([zeros if t is None else t.hits for t in tables], dtype=np.float64)
        reached = np.array([zeros if t is None else t.reached for t in tables], dtype=np.float64)
        return (hits + ROW_PRIOR * prior) / (reached + ROW_PRIOR)

    def overall(self, drafter: str, temperature: float) -> list[float]:
        key = (drafter, temperature_bucket(temperature))
        got = self._overall.get(key)
        if got is None:
            got = self._overall[key] = self._table(*key).rates()
        return got

    def forget_row(self, slot: int) -> None:
        """A request left the slot: its own counts go (the drafter's stay)."""
        for key in [k for k in self._rows if k[1] == slot]:
            del self._rows[key]

    def snapshot(self) -> dict[str, list[float]]:
        """`drafter@T-bucket` → α_d, for reports."""
        return {f"{d}@t{b}": [round(x, 3) for x in t.rates()] for (d, b), t in sorted(self._global.items())}


class ShadowScorer:
    """Scores one draftless drafter against the tokens rows emit (see the module docstring).

    A proposal is asked for before *every* step of every row, and each stays pending until the tokens the
    row emits settle it (a miss, or its end): under plans that emit a token or two a step, several are live
    at once, and the depths a live proposal has matched count as accepted at once (its miss, or its end,
    when it settles). Asking only when none was pending, and counting a proposal only when it settled, scored
    one proposal per four steps or so: at a request's start the policy planned for many steps on the
    drafter's prior instead of what it measured (on code editing: γ1 for its first ten steps where γ4-γ7 was
    right)."""

    def __init__(self, name: str, drafter, acceptance: LiveAcceptance, depth: int):
        self.name, self.drafter, self.acceptance, self.depth = name, drafter, acceptance, depth
        # slot → its live proposals, oldest first: [proposal, temperature, tokens of it matched so far]
        self._pending: dict[int, list[list]] = {}
        self.scored = 0  # proposals scored (reports)

    def before(self, slot: int, history: list[int], temperature: float) -> int:
        """The row's tokens (prompt + output, its newest last) before a step → the length of what the drafter
        proposes there (0: nothing — a step of this drafter would decode the row plainly)."""
        proposal = self.drafter.shadow_propose(slot, history, self.depth)
        if proposal:  # (nothing proposed teaches nothing about acceptance: the policy plans around it)
            self._pending.setdefault(slot, []).append([proposal, temperature, 0])
        return len(proposal)

    def after(self, slot: int, emitted: list[int]) -> None:
        """The tokens the row emitted in the step (after the history `before` saw). A proposal whose every
        token so far matched stays pending across steps (an AR step emits one token at a time)."""
        self.settle(slot, self.take(slot), emitted)

    def take(self, slot: int) -> list:
        """The row's pending proposals, handed over to a later `settle` (proposals asked for meanwhile pend
        after them): scoring a step may run after the next step's proposals were asked for."""
        return self._pending.pop(slot, [])

    def settle(self, slot: int, live: list, emitted: list[int]) -> None:
        """`after` for proposals `take` handed over: score them against the tokens emitted; those still
        matching pend again, before any asked for since."""
        if not live:
            return
        still = []
        for entry in live:
            proposal, temperature, matched = entry
            rest = proposal[matched:]
            k = 0
            while k < len(emitted) and k < len(rest) and emitted[k] == rest[k]:
                k += 1
            if rest and k == len(emitted) and k < len(rest):
                # every token so far matched: those depths count as accepted now (the policy sees them this
                # step, not when the proposal ends), the rest when it settles
                self.acceptance.record(self.name, slot, temperature, matched + k, matched + k, start=matched)
                entry[2] = matched + k
                still.append(entry)
                continue
            self.acceptance.record(self.name, slot, temperature, matched + k, len(proposal), start=matched)
            self.scored += 1
        newer = self._pending.get(slot)
        self._pending[slot] = still + newer if newer else still

    def forget(self, slot: int) -> None:
        self._pending.pop(slot, None)
