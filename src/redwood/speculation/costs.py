"""What a step costs on the running device: a calibrated table of forward times, corrected online.

The automatic policy (`speculation.policy`) compares plans by expected tokens per second, so it needs each
plan's step time before running it. Every step is a few forwards of one model over a few new tokens per
row, so the table holds forward times:

    forward(model, b rows, T new tokens per row, context n) ≈ w(b·T) + s(T) · b' · n      seconds

(b' ≤ b: the rows that read their context — a batch bucket's finished rows compute but read none)

w(N) — the time of a forward over N new tokens at a short context (weights read once, N tokens of compute)
— and s(T), the extra per row and context slot (attention reads), come from a calibration at one row:
forwards of N = 1, 2, 4, … tokens at a short and a long context (`engine.calibrate`), interpolated
piecewise-linearly in N (clamped, then extended by the last slope) and linearly in n. The batch enters as
its total of new tokens and its rows' reads: a first guess the online correction makes good.

The correction: every timed step divides the measured time by this table's prediction; a decayed
geometric mean of that ratio (decayed per observation, and further by its age in steps: a plan probed now
and then is costed by its latest probes) is kept per (plan family, step shape, batch bucket) and per (family, bucket) —
family "ar" or a drafter's name. A shape already run is predicted with its own ratio (the plan in use is
costed by what it measured, whatever the calibration's error at its size); any other with its family's; a bucket
the family has not run at, with its nearest bucket's moved as plain decoding's moved between the two. A
graphed GPU step is timed whole, so the whole step is corrected, never its parts.

`CostTable` round-trips through JSON (the calibration cache, `costs_cache`); the cache's key names what
the times depend on (device, model, dtype, weight format, threads, backend settings, tensor-parallel size,
redwood's version).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

COSTS_FORMAT = "redwood.costs/1"
AGE_DECAY = 0.97  # per step: a ratio last updated 23 steps ago keeps half its weight against a new one
CATCH_UP = "catch-up"  # the correction family of draft-model catch-ups (`CostModel.catch_up`)
YARDSTICK = "ar"  # the family measured at every bucket: how the table's error moves between buckets (`correction`)
PLAUSIBLE_SLACK = 1.25  # a cached curve may dip this much (calibrations are monotone; hand edits, old files)


@dataclass
class ForwardCurve:
    """One model's calibrated forward times at one row: tokens N → seconds, at contexts lo and hi."""

    tokens: list[int]  # ascending, starting at 1
    lo_ctx: int
    hi_ctx: int
    lo_s: list[float]  # [len(tokens)] at context lo_ctx
    hi_s: list[float]  # [len(tokens)] at context hi_ctx
    # (rows, tokens) → (base seconds, seconds per slot read): `seconds` interpolates each pair once — a plan asks for
    # ~30 forwards a step, the same ones every step but for the context (an H100 host at batch 1: 0.3–0.5 ms a plan)
    _parts: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.lo_s) != len(self.tokens) or len(self.hi_s) != len(self.tokens):
            raise ValueError("a forward curve needs one time per token count at both contexts")
        if self.hi_ctx <= self.lo_ctx:
            raise ValueError("the long context must exceed the short one")
        if any(not (t > 0 and math.isfinite(t)) for t in self.lo_s + self.hi_s):
            raise ValueError("forward times must be positive and finite")

    def monotone(self) -> "ForwardCurve":
        """This curve with every time lowered to the least of the times that cannot be smaller — at more
        tokens, or at the long context (noise from other work only adds time, so the smaller one is the
        truer)."""
        lo = [min(a, b) for a, b in zip(self.lo_s, self.hi_s)]
        out = []
        for times in (lo, self.hi_s):
            times = list(times)
            for i in range(len(times) - 2, -1, -1):
                times[i] = min(times[i], times[i + 1])
            out.append(times)
        return ForwardCurve(list(self.tokens), self.lo_ctx, self.hi_ctx, out[0], out[1])

    def implausible(self, slack: float = PLAUSIBLE_SLACK) -> str | None:
        """Why these times cannot describe one quiet machine (a forward over fewer tokens, or at a shorter
        context, taking over `slack` times as long), or None."""
        for name, ctx, times in (("short", self.lo_ctx, self.lo_s), ("long", self.hi_ctx, self.hi_s)):
            for (n0, t0), (n1, t1) in zip(zip(self.tokens, times), zip(self.tokens[1:], times[1:])):
                if t0 > slack * t1:
                    return f"{n0} new tokens timed {t0 / t1:.1f}x slower than {n1} at context {ctx} ({name})"
        for n, a, b in zip(self.tokens, self.lo_s, self.hi_s):
            if a > slack * b:
                return f"{n} new tokens timed {a / b:.1f}x slower at context {self.lo_ctx} than at {self.hi_ctx}"
        return None

    @staticmethod
    def _interp(xs: list[int], ys: list[float], x: float) -> float:
        """Piecewise-linear in x; past the last point the last segment's slope continues (never below the
        last value: a forward over more tokens never costs less)."""
        if x <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, x)
        if i < len(xs):
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (x - xs[-1])

    def seconds(self, rows: int, tokens: int, context: int, live: int | None = None) -> float:
        """A forward over `tokens` new tokens in each of `rows` rows, `live` of them (default: all) reading
        `context` slots each — a graphed batch bucket computes every slot's tokens, but a finished row's
        context is never read (the attention kernels skip rows that are not live)."""
        parts = self._parts.get((rows, tokens))
        if parts is None:
            base = self._interp(self.tokens, self.lo_s, rows * tokens)
            per_slot = (self._interp(self.tokens, self.hi_s, tokens) - self._interp(self.tokens, self.lo_s, tokens)) / (
                self.hi_ctx - self.lo_ctx
            )
            parts = self._parts[(rows, tokens)] = (base, max(per_slot, 0.0))
        base, per_slot = parts
        readers = rows if live is None else live
        return max(base + per_slot * readers * max(context - self.lo_ctx, 0), 1e-9)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "lo_ctx": self.lo_ctx,
            "hi_ctx": self.hi_ctx,
            "lo_s": self.lo_s,
            "hi_s": self.hi_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ForwardCurve":
        return cls([int(t) for t in d["tokens"]], int(d["lo_ctx"]), int(d["hi_ctx"]), list(d["lo_s"]), list(d["hi_s"]))


@dataclass
class CostTable:
    """Calibrated forward curves: the target's, and a standalone draft model's (None without one)."""

    target: ForwardCurve
    draft: ForwardCurve | None = None

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft": None if self.draft is None else self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        draft = d.get("draft")
        return cls(ForwardCurve.from_dict(d["target"]), None if draft is None else ForwardCurve.from_dict(draft))

    def implausible(self) -> str | None:
        """Why this table cannot be a quiet machine's (`ForwardCurve.implausible`), or None."""
        for name, curve in (("target", self.target), ("draft", self.draft)):
            why = None if curve is None else curve.implausible()
            if why is not None:
                return f"the {name}'s {why}"
        return None


@dataclass
class StepShape:
    """What a plan's step runs, per row: `verify` new tokens through the target at the rows' context, and
    `levels` draft forwards of `level_tokens[i]` tokens each — through the target at `draft_context`
    (self-speculation over a compressed view) or through the draft model (`draft_model`)."""

    verify: int = 1
    level_tokens: tuple[int, ...] = ()
    draft_model: bool = False
    draft_context: int | None = None  # None: the rows' own context


@dataclass
class CostModel:
    """Predicted step times from a `CostTable`, corrected online per (family, shape, bucket) and per (family,
    bucket)."""

    table: CostTable
    decay: float = 0.8  # weight of the old log-ratio at each observation
    age_decay: float = AGE_DECAY  # and its further weight per step (any plan's) since it was last updated
    # key → (decayed log-ratio, `observations` when last updated)
    _log_ratio: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    _shape_log_ratio: dict[tuple, tuple[float, int]] = field(default_factory=dict)
    observations: int = 0  # timed steps seen (the clock of the ratios' ages)

    def raw(self, shape: StepShape, rows: int, context: int, live: int | None = None) -> float:
        """The table's prediction for one step of `shape` over `rows` rows (a batch bucket), `live` of them
        (default: all) reading `context` slots each."""
        t = self.table.target.seconds(rows, shape.verify, context, live)
        if shape.level_tokens:
            curve = self.table.draft if shape.draft_model else self.table.target
            if curve is None:
                raise ValueError("a draft-model step needs the draft model's calibrated curve")
            ctx = context if shape.draft_context is None else min(context, shape.draft_context)
            level_s: dict[int, float] = {}  # (a chain's levels are alike: each width costed once, summed in order)
            levels = 0.0
            for k in shape.level_tokens:
                if k not in level_s:
                    level_s[k] = curve.seconds(rows, k, ctx, live)
                levels += level_s[k]
            t += levels
        return t

    def correction(self, family: str, bucket: int, shape: StepShape | None = None) -> float:
        """The learnt measured / predicted ratio for `shape` of a family at a bucket if that was run, else the
        family's at the bucket (1 before any step). A bucket the family never ran at borrows its nearest
        measured bucket's ratio, moved by how plain decoding's ratio differs between the two buckets where both
        are measured (plain decoding runs at every bucket — its probes — and the table's error grows with the
        batch for every family alike: on an H100 at 16K context plain decoding measured 0.51 at bucket 16 and
        0.20 at 64, and self-speculation, costed at 64 by its 0.82 from 16, was never chosen there); a family
        never measured at all takes plain decoding's ratio at the bucket."""
        if shape is not None:
            got = self._shape_log_ratio.get((family, _shape_key(shape), bucket))
            if got is not None:
                return math.exp(got[0])
        got = self._log_ratio.get((family, bucket))
        if got is not None:
            return math.exp(got[0])
        yard = self._log_ratio.get((YARDSTICK, bucket)) if family not in (YARDSTICK, CATCH_UP) else None
        near = [
            (abs(math.log2(b) - math.log2(bucket)), b, v[0]) for (f, b), v in self._log_ratio.items() if f == family
        ]
        if not near:
            return math.exp(yard[0] if yard is not None else 0.0)
        _, b, value = min(near)
        there = self._log_ratio.get((YARDSTICK, b))
        if yard is not None and there is not None:
            value += yard[0] - there[0]
        return math.exp(value)

    def snapshot(self) -> dict[str, float]:
        """The learnt measured / predicted step-time ratios per family and batch bucket ("family@bucket"; the
        catch-up's as "catch-up@bucket") — how far the calibration was off on the steps that ran."""
        return {f"{f}@{b}": round(math.exp(v[0]), 3) for (f, b), v in sorted(self._log_ratio.items())}

    def _blend(self, ratios: dict, key, r: float) -> None:
        """Fold log-ratio r into ratios[key]: the old value keeps `decay`, less for every step since it was
        last updated (a plan probed once in a while is costed by its probe, not by what it measured long ago
        — while the machine warmed up, or before another process started)."""
        old = ratios.get(key)
        if old is None:
            ratios[key] = (r, self.observations)
            return
        value, at = old
        keep = self.decay * self.age_decay ** max(self.observations - at - 1, 0)
        ratios[key] = (keep * value + (1 - keep) * r, self.observations)

    def catch_up(self, rows: int, tokens: int, bucket: int, context: int) -> float:
        """A draft model's catch-up: one draft forward over the `tokens` it missed in each of `rows` rows
        (steps of other plans committed them), corrected by the catch-ups measured (family "catch-up")."""
        if self.table.draft is None or tokens <= 0:
            return 0.0
        return self.table.draft.seconds(rows, tokens, context) * self.correction(CATCH_UP, bucket)

    def observe_catch_up(self, rows: int, tokens: int, bucket: int, context: int, seconds: float) -> None:
        if self.table.draft is None or tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._blend(
            self._log_ratio, (CATCH_UP, bucket), math.log(seconds / self.table.draft.seconds(rows, tokens, context))
        )

    def predict(
        self, family: str, shape: StepShape, rows: int, bucket: int, context: int, live: int | None = None
    ) -> float:
        """A step's predicted seconds: `rows` rows computed at batch bucket `bucket`, `live` of them (default:
        all) reading `context` slots each. Why `live` apart: as a burst drains, its last rows run in the
        bucket they started in (an H100 at 64 × 30K: plain decoding 22 ms a step with 64 rows reading, 3.2 ms
        with 7), so a correction learnt from bucket-sized reads would be 5× off on the tail and back."""
        return self.raw(shape, rows, context, live) * self.correction(family, bucket, shape)

    def observe(
        self,
        family: str,
        shape: StepShape,
        rows: int,
        bucket: int,
        context: int,
        seconds: float,
        live: int | None = None,
    ) -> None:
        """A step of this family and shape took `seconds` (captures left out)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        r = math.log(seconds / self.raw(shape, rows, context, live))
        self.observations += 1
        self._blend(self._log_ratio, (family, bucket), r)
        self._blend(self._shape_log_ratio, (family, _shape_key(shape), bucket), r)


def _shape_key(shape: StepShape) -> tuple:
    return (shape.verify, shape.level_tokens, shape.draft_model, shape.draft_context)
