"""Optimal token trees (Sequoia's dynamic program) and hardware-aware size/depth selection.

**Model.** Under the positional-acceptance assumption the k-th ranked child of an accepted node is the
accepted one with probability p_k (unconditional, Σ p_k ≤ 1), optionally depending on the child's depth
(p_{d,k}). A node's chance of being reached is the product of p along its root path, and a tree's
expected tokens per step is the sum of these over all nodes, the root counting 1 (the token the target
always yields).

**DP.** Let G_l[m] be the best value of a subtree with exactly m nodes and at most l levels, hanging
off a node at a given depth. Build the root's children one rank at a time: with T_b[m] the best value
using the root plus its first b child-subtrees,

    T_0[1] = 1
    T_1[m] = 1 + p_1 · G_{l-1}[m-1]
    T_b[m] = max_y ( T_{b-1}[y] + p_b · G_{l-1}[m-y] )      (b ≥ 2)
    G_l[m] = max_b T_b[m]

The max over y is a max-plus convolution; it is computed for all m at once as one (m, y) array per
(level, rank), so the work is O(D · W) array operations of size N², with no Python loop over m or y.
With per-depth acceptance the table also depends on the depth of the subtree's root; tables are
memoised on (depth, levels), collapsing depths past the last per-depth row.

`results[n][d]` (n nodes exactly, root included; at most d levels, root counted) is -inf where no
such tree exists (e.g. more nodes than W ranks allow in d levels).

**Selection.** For a latency profile (target latency against tokens, draft latency against width,
optional sampling/verification overhead against tokens), the predicted time per generated token of the
DP tree for (n, d) is

    τ(n, d) = ( Σ_{j=0}^{k-2} t_draft(w_j) + t_draft(1) + t_target(n) + t_overhead(n) ) / results[n][d]

where w_j are the tree's level widths and k ≤ d its levels: one draft forward over each non-leaf level
grows the tree, and one more (width 1) processes the new bonus token — with a width-independent draft
time this is Sequoia's d · t_draft. Predicted speedup = t_target(1) / τ. Latencies are interpolated
linearly between measured sizes and never extrapolated: sizes past the largest measured target size
(or trees with a level wider than the widest measured draft width) are not candidates. A draft curve
with one point (width 1) is taken as width-independent, which reproduces the original's d · t_draft.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from redwood.errors import ConfigError
from redwood.jsonfile import check_format, read_json, write_json
from redwood.speculation.trees import Tree, acceptance_rows
from redwood.tuning.acceptance import AcceptanceVector

NEG = -np.inf


# ---------------------------------------------------------------------- the DP
def _maxplus_step(prev: np.ndarray, child: np.ndarray, lo: int, block: int = 64):
    """out[m] = max_{y ≥ lo, m-y ≥ 1} prev[y] + child[m-y], with the argmax y; -inf / -1 if none.

    The (m, y) sums are formed as strided views (rows[m, y] = child[m - y]), one block of m at a time
    so that only the lower triangle y < m is materialised."""
    n1 = prev.shape[0]
    big = np.full(2 * n1 - 1, NEG)
    big[:n1] = child[::-1]
    rows = sliding_window_view(big, n1)[::-1]  # a view: no copy
    val = np.full(n1, NEG)
    arg = np.full(n1, -1, dtype=np.int64)
    for m0 in range(lo + 1, n1, block):
        m1 = min(m0 + block, n1)
        s = rows[m0:m1, lo : m1 - 1] + prev[None, lo : m1 - 1]
        a = s.argmax(axis=1)
        val[m0:m1] = s[np.arange(m1 - m0), a]
        arg[m0:m1] = a + lo
    arg[~np.isfinite(val)] = -1
    return val, arg


def _level_table(child: np.ndarray | None, p: np.ndarray, n1: int):
    """One level of the DP: best subtree values G_l[m] (m = 0..n1-1) given the child tables G_{l-1}
    (None for l = 1) and the children's per-rank acceptance p. Returns (G, best_b, argy) where
    argy[b][m] is the y chosen for rank b (b ≥ 2)."""
    g = np.full(n1, NEG)
    if n1 > 1:
        g[1] = 1.0
    best_b = np.zeros(n1, dtype=np.int32)
    width = len(p)
    argy = np.full((width + 1, n1), -1, dtype=np.int32)
    if child is None or n1 <= 2:
        return g, best_b, argy
    fin = np.isfinite(child)
    t = np.full(n1, NEG)
    for b in range(1, width + 1):
        pc = np.where(fin, p[b - 1] * np.where(fin, child, 0.0), NEG)
        if b == 1:
            t = np.full(n1, NEG)
            t[1:] = 1.0 + pc[:-1]
            t[:2] = NEG
        else:
            t, arg = _maxplus_step(t, pc, lo=b)
            argy[b] = arg
        better = t > g
        if not better.any():
            if not np.isfinite(t).any():
                break
            continue
        g = np.where(better, t, g)
        best_b[better] = b
    return g, best_b, argy


@dataclass(eq=False)
class TreeDP:
    """A solved DP: `results[n][d]` for n ≤ max_budget, d ≤ max_depth, and the choices to rebuild trees."""

    rows: list[np.ndarray]
    max_budget: int
    max_depth: int
    results: np.ndarray
    _tables: dict = field(default_factory=dict, repr=False)
    _widths: dict = field(default_factory=dict, repr=False)

    def _canon(self, depth: int) -> int:
        # subtrees rooted at depth a use rows a+1, a+2, ...; past the last row they are all the same
        return min(depth, len(self._distinct_rows) - 1)

    @property
    def _distinct_rows(self) -> list[np.ndarray]:
        rows = self.rows
        last = len(rows)
        while last > 1 and np.array_equal(rows[last - 1], rows[last - 2]):
            last -= 1
        return rows[:last]

    def _table(self, depth: int, levels: int):
        key = (self._canon(depth), levels)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        n1 = self.max_budget + 1
        if levels == 1:
            res = _level_table(None, self.rows[0], n1)
        else:
            child = self._table(depth + 1, levels - 1)[0]
            res = _level_table(child, self.rows[min(depth, len(self.rows) - 1)], n1)
        self._tables[key] = res
        return res

    def expected(self, n: int, d: int) -> float:
        return float(self.results[n, d])

    def child_sizes(self, depth: int, levels: int, m: int) -> list[int]:
        """Subtree sizes of the children (rank order) of an optimal m-node, ≤levels subtree at `depth`."""
        g, best_b, argy = self._table(depth, levels)
        if not np.isfinite(g[m]):
            raise ConfigError(f"no tree with {m} nodes fits in {levels} levels with {len(self.rows[0])} ranks")
        b = int(best_b[m])
        sizes = []
        mm = m
        for bb in range(b, 1, -1):
            y = int(argy[bb][mm])
            sizes.append(mm - y)
            mm = y
        if b >= 1:
            sizes.append(mm - 1)
        sizes.reverse()
        return sizes

    def tree(self, n: int, d: int, meta: Mapping[str, Any] | None = None) -> Tree:
        """The optimal tree with exactly n nodes and at most d levels, numbered breadth-first."""
        if not (1 <= n <= self.max_budget and 1 <= d <= self.max_depth):
            raise ConfigError(f"(n={n}, d={d}) is outside the solved range n ≤ {self.max_budget}, d ≤ {self.max_depth}")
        if not np.isfinite(self.results[n, d]):
            raise ConfigError(f"no tree with {n} nodes fits in {d} levels with {len(self.rows[0])} ranks")
        parents = [-1]
        queue = [(0, d, n)]  # (depth, levels allowed, nodes) per node, in node-id order
        head = 0
        while head < len(queue):
            depth, levels, m = queue[head]
            if m > 1:
                for s in self.child_sizes(depth, levels, m):
                    parents.append(head)
                    queue.append((depth + 1, levels - 1, s))
            head += 1
        return Tree(tuple(parents), meta=dict(meta or {}))

    def level_widths(self, n: int, d: int, depth: int = 0) -> tuple[int, ...]:
        """Level widths of the optimal (n, d) tree, without building it (memoised)."""
        key = (n, d, self._canon(depth))
        hit = self._widths.get(key)
        if hit is not None:
            return hit
        widths = [1]
        if n > 1:
            for s in self.child_sizes(depth, d, n):
                sub = self.level_widths(s, d - 1, depth + 1)
                for j, w in enumerate(sub, start=1):
                    if j < len(widths):
                        widths[j] += w
                    else:
                        widths.append(w)
        out = tuple(widths)
        self._widths[key] = out
        return out


def solve_tree_dp(acceptance, max_budget: int, max_depth: int, use_per_depth: bool = True, progress=None) -> TreeDP:
    """Run the DP for all n ≤ max_budget and d ≤ max_depth (see the module docstring).

    progress: called with no argument after each depth bound d is solved (max_depth calls; each
    costs about the same, W max-plus convolutions over [n, n] arrays)."""
    for v, what in ((max_budget, "budget"), (max_depth, "max depth")):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{what} must be a positive integer, got {v!r}")
    rows = acceptance_rows(acceptance, use_per_depth=use_per_depth)
    dp = TreeDP(rows=rows, max_budget=int(max_budget), max_depth=int(max_depth), results=None)
    results = np.full((max_budget + 1, max_depth + 1), NEG)
    for d in range(1, max_depth + 1):
        results[:, d] = dp._table(0, d)[0]
        if progress is not None:
            progress()
    results[0, :] = NEG
    dp.results = results
    return dp


def expected_tokens_table(acceptance, max_budget: int, max_depth: int, use_per_depth: bool = True) -> np.ndarray:
    """results[n][d]: best expected tokens per step (root counts 1) over trees of exactly n nodes with at
    most d levels (root counted); shape [max_budget + 1, max_depth + 1]; -inf where infeasible (row 0,
    column 0, and sizes that W ranks cannot reach in d levels)."""
    return solve_tree_dp(acceptance, max_budget, max_depth, use_per_depth).results


def _provenance(acceptance, budget: int, max_depth: int, expected: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "generator": "redwood tree-search",
        "budget": int(budget),
        "max_depth": int(max_depth),
        "expected_tokens": round(float(expected), 6),
    }
    if isinstance(acceptance, AcceptanceVector):
        meta["acceptance"] = acceptance.to_dict()
        if acceptance.models:
            meta["models"] = dict(acceptance.models)
        if acceptance.temperature is not None:
            meta["temperature"] = acceptance.temperature
    else:
        rows = acceptance_rows(acceptance)
        if len(rows) == 1:
            meta["acceptance"] = AcceptanceVector(values=tuple(rows[0].tolist())).to_dict()
        else:
            meta["acceptance"] = AcceptanceVector(
                values=tuple(rows[0].tolist()), per_depth=tuple(tuple(r.tolist()) for r in rows)
            ).to_dict()
    return meta


def optimal_tree(acceptance, budget: int, max_depth: int, use_per_depth: bool = True) -> tuple[Tree, float]:
    """The tree with at most `budget` nodes and `max_depth` levels maximising expected tokens per step.

    Adding a node never lowers the expectation, so this is the best tree of exactly `budget` nodes when
    one fits in `max_depth` levels with the vector's W ranks, else the largest tree that fits. The tree's
    meta carries the acceptance vector, budget, depth bound and expected tokens."""
    dp = solve_tree_dp(acceptance, budget, max_depth, use_per_depth)
    col = dp.results[:, max_depth]
    feasible = np.nonzero(np.isfinite(col))[0]
    n = int(feasible.max())
    expected = float(col[n])
    return dp.tree(n, max_depth, meta=_provenance(acceptance, budget, max_depth, expected)), expected


# ---------------------------------------------------------------------- latency profiles
PROFILE_FORMAT = "redwood.profile/1"


def _curve(d: Any, xkey: str, source: str, what: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if not isinstance(d, Mapping) or xkey not in d or "ms" not in d:
        raise ConfigError(f"{source}: '{what}' must be an object with '{xkey}' and 'ms' lists")
    xs, ys = d[xkey], d["ms"]
    if not isinstance(xs, Sequence) or not isinstance(ys, Sequence) or len(xs) != len(ys) or len(xs) == 0:
        raise ConfigError(f"{source}: {what}.{xkey} and {what}.ms must be non-empty lists of equal length")
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ConfigError(f"{source}: {what}.{xkey} must hold positive integers, got {x!r}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ConfigError(f"{source}: {what}.{xkey} must be strictly increasing")
    for y in ys:
        if isinstance(y, bool) or not isinstance(y, (int, float)) or not math.isfinite(y) or y < 0:
            raise ConfigError(f"{source}: {what}.ms must hold non-negative finite numbers, got {y!r}")
    return tuple(int(x) for x in xs), tuple(float(y) for y in ys)


@dataclass(frozen=True)
class LatencyProfile:
    """Measured latencies on one device / dtype / batch / context (times in milliseconds).

    JSON (``redwood.profile/1``)::

        {"format": "redwood.profile/1", "device": "...", "dtype": "float32", "batch": 1, "context": 512,
         "models": {"target": ..., "draft": ...},
         "target": {"tokens": [1, 2, 4, ...], "ms": [...]},     # one target forward over n tokens
         "draft": {"width": [1, 2, 4, ...], "ms": [...]},       # one draft forward over w tokens
         "overhead": {"tokens": [...], "ms": [...]},            # optional: sampling + verify + commit per step
         "notes": {...}}

    `overhead` may also be a single number (ms per step). Target sizes must include 1 (the
    autoregressive baseline) and draft widths must include 1. A draft curve with a single point (width 1)
    is width-independent, as in the original; otherwise latencies are interpolated linearly between the
    measured sizes and never extrapolated (`target`/`draft` raise ConfigError outside the range).
    """

    target_tokens: tuple[int, ...]
    target_ms: tuple[float, ...]
    draft_width: tuple[int, ...]
    draft_ms: tuple[float, ...]
    overhead_tokens: tuple[int, ...] | None = None
    overhead_ms: tuple[float, ...] | float | None = None
    device: str | None = None
    dtype: str | None = None
    batch: int | None = None
    context: int | None = None
    models: Mapping[str, Any] = field(default_factory=dict, compare=False)
    notes: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        src = "profile"
        tt, tm = _curve({"tokens": list(self.target_tokens), "ms": list(self.target_ms)}, "tokens", src, "target")
        dw, dm = _curve({"width": list(self.draft_width), "ms": list(self.draft_ms)}, "width", src, "draft")
        if tt[0] != 1:
            raise ConfigError("profile: target latency must be measured at 1 token (the autoregressive baseline)")
        if dw[0] != 1:
            raise ConfigError("profile: draft latency must be measured at width 1")
        object.__setattr__(self, "target_tokens", tt)
        object.__setattr__(self, "target_ms", tm)
        object.__setattr__(self, "draft_width", dw)
        object.__setattr__(self, "draft_ms", dm)
        if self.overhead_tokens is not None:
            ot, om = _curve(
                {"tokens": list(self.overhead_tokens), "ms": list(self.overhead_ms or [])}, "tokens", src, "overhead"
            )
            object.__setattr__(self, "overhead_tokens", ot)
            object.__setattr__(self, "overhead_ms", om)
        elif self.overhead_ms is not None:
            v = self.overhead_ms
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"profile: overhead must be a non-negative number or a curve, got {v!r}")
            object.__setattr__(self, "overhead_ms", float(v))
        object.__setattr__(self, "models", dict(self.models or {}))
        object.__setattr__(self, "notes", dict(self.notes or {}))

    @property
    def max_tokens(self) -> int:
        return self.target_tokens[-1]

    @property
    def max_width(self) -> int | float:
        return math.inf if len(self.draft_width) == 1 else self.draft_width[-1]

    @staticmethod
    def _interp(xs, ys, x, what: str) -> float:
        if x < xs[0] or x > xs[-1]:
            raise ConfigError(
                f"{what} at {x} is outside the measured range [{xs[0]}, {xs[-1]}]; "
                f"profile more sizes (latencies are not extrapolated)"
            )
        return float(np.interp(x, xs, ys))

    def target(self, n: int) -> float:
        return self._interp(self.target_tokens, self.target_ms, n, "target latency")

    def draft(self, width: int) -> float:
        if len(self.draft_width) == 1:  # a single measurement: width-independent (the original's model)
            return self.draft_ms[0]
        return self._interp(self.draft_width, self.draft_ms, width, "draft latency")

    def overhead(self, n: int) -> float:
        if self.overhead_ms is None:
            return 0.0
        if self.overhead_tokens is None:
            return float(self.overhead_ms)
        # outside the measured overhead sizes the nearest measurement is used (it is a small term)
        return float(np.interp(n, self.overhead_tokens, self.overhead_ms))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "device": self.device,
            "dtype": self.dtype,
            "batch": self.batch,
            "context": self.context,
            "models": dict(self.models),
            "target": {"tokens": list(self.target_tokens), "ms": list(self.target_ms)},
            "draft": {"width": list(self.draft_width), "ms": list(self.draft_ms)},
        }
        if self.overhead_tokens is not None:
            d["overhead"] = {"tokens": list(self.overhead_tokens), "ms": list(self.overhead_ms)}
        elif self.overhead_ms is not None:
            d["overhead"] = self.overhead_ms
        if self.notes:
            d["notes"] = dict(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "profile") -> "LatencyProfile":
        check_format(d, PROFILE_FORMAT, source)
        for key in ("target", "draft"):
            if key not in d:
                raise ConfigError(f"{source}: missing '{key}' latencies")
        tt, tm = _curve(d["target"], "tokens", source, "target")
        dw, dm = _curve(d["draft"], "width", source, "draft")
        ot = om = None
        ov = d.get("overhead")
        if isinstance(ov, Mapping):
            ot, om = _curve(ov, "tokens", source, "overhead")
        elif ov is not None:
            om = ov
        try:
            return cls(
                target_tokens=tt,
                target_ms=tm,
                draft_width=dw,
                draft_ms=dm,
                overhead_tokens=ot,
                overhead_ms=om,
                device=d.get("device"),
                dtype=d.get("dtype"),
                batch=d.get("batch"),
                context=d.get("context"),
                models=d.get("models") or {},
                notes=d.get("notes") or {},
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {str(e).removeprefix('profile: ')}") from None


def load_profile(path: str | Path) -> LatencyProfile:
    return LatencyProfile.from_dict(read_json(path, "profile"), source=str(path))


def save_profile(profile: LatencyProfile, path: str | Path) -> Path:
    return write_json(path, profile.to_dict())


# ---------------------------------------------------------------------- selection
@dataclass(frozen=True)
class Candidate:
    size: int
    depth: int  # levels of the actual tree (≤ the depth bound it was solved under)
    expected: float
    widths: tuple[int, ...]
    draft_ms: float
    target_ms: float
    overhead_ms: float
    tau_ms: float
    speedup: float


@dataclass
class Selection:
    tree: Tree
    best: Candidate
    candidates: list[Candidate]  # the best few, best first
    baseline_ms: float  # t_target(1)
    skipped_wide: int  # candidates dropped because a level is wider than the profiled draft widths
    max_size: int  # largest size considered (min of budget and largest profiled target size)


def step_time(profile: LatencyProfile, widths: Sequence[int], n: int) -> tuple[float, float, float]:
    """(draft, target, overhead) ms of one speculation step with a tree of `n` nodes and level `widths`."""
    draft = sum(profile.draft(w) for w in widths[:-1]) + profile.draft(1)
    return draft, profile.target(n), profile.overhead(n)


def select_tree(
    acceptance,
    profile: LatencyProfile,
    max_budget: int,
    max_depth: int,
    top: int = 5,
    use_per_depth: bool = True,
    sizes: str = "all",
    progress=None,
) -> Selection:
    """Pick the DP tree (size ≤ max_budget, levels ≤ max_depth) minimising predicted time per token
    (`progress`: as `solve_tree_dp`'s).

    `sizes`: "all" considers every size up to min(max_budget, largest profiled target size), with target
    latency interpolated linearly; "measured" only the profiled target sizes (as the original does)."""
    if sizes not in ("all", "measured"):
        raise ConfigError(f"sizes must be 'all' or 'measured', got {sizes!r}")
    if isinstance(max_budget, bool) or not isinstance(max_budget, (int, np.integer)) or max_budget < 1:
        raise ConfigError(f"budget must be a positive integer, got {max_budget!r}")
    n_max = min(int(max_budget), profile.max_tokens)
    dp = solve_tree_dp(acceptance, n_max, max_depth, use_per_depth, progress=progress)
    res = dp.results
    baseline = profile.target(1)
    min_draft = min(profile.draft_ms)
    # lower bound of τ for every (n, d): the draft costs at least one forward per level
    ns, ds, lbs = [], [], []
    tgt = np.array([0.0] + [profile.target(n) + profile.overhead(n) for n in range(1, n_max + 1)])
    for d in range(1, max_depth + 1):
        col = res[:, d]
        ok = np.nonzero(np.isfinite(col))[0]
        ok = ok[ok >= 1]
        if sizes == "measured":
            ok = ok[np.isin(ok, profile.target_tokens)]
        min_levels = np.minimum(d, np.where(ok > 1, 2, 1))
        lb = (tgt[ok] + min_levels * min_draft) / col[ok]
        ns.append(ok)
        ds.append(np.full(len(ok), d))
        lbs.append(lb)
    ns, ds, lbs = np.concatenate(ns), np.concatenate(ds), np.concatenate(lbs)
    order = np.lexsort((ds, ns, lbs))
    found: dict[tuple[int, int], Candidate] = {}
    skipped = 0
    top = max(1, int(top))
    taus: list[float] = []  # sorted τ of the candidates found so far
    for idx in order:
        if len(taus) >= top and lbs[idx] > taus[top - 1]:
            break
        n, d = int(ns[idx]), int(ds[idx])
        widths = dp.level_widths(n, d)
        key = (n, len(widths))
        if key in found:
            continue
        if max(widths) > profile.max_width:
            skipped += 1
            continue
        dr, tg, ov = step_time(profile, widths, n)
        e = float(res[n, d])
        tau = (dr + tg + ov) / e
        bisect.insort(taus, tau)
        found[key] = Candidate(
            size=n,
            depth=len(widths),
            expected=e,
            widths=widths,
            draft_ms=dr,
            target_ms=tg,
            overhead_ms=ov,
            tau_ms=tau,
            speedup=baseline / tau,
        )
    if not found:
        raise ConfigError(
            f"no candidate tree fits the profile: every tree has a level wider than the widest "
            f"profiled draft width ({profile.max_width}); profile wider draft batches"
        )
    ranked = sorted(found.values(), key=lambda c: (c.tau_ms, c.size, c.depth))[:top]
    best = ranked[0]
    meta = _provenance(acceptance, max_budget, max_depth, best.expected)
    meta.update(
        {
            "selected": {
                "size": best.size,
                "depth": best.depth,
                "tau_ms": round(best.tau_ms, 6),
                "predicted_speedup": round(best.speedup, 6),
            },
            "profile": {k: v for k, v in profile.to_dict().items() if k != "notes"},
        }
    )
    if profile.models and "models" not in meta:
        meta["models"] = dict(profile.models)
    tree = dp.tree(best.size, best.depth, meta=meta)
    return Selection(
        tree=tree, best=best, candidates=ranked, baseline_ms=baseline, skipped_wide=skipped, max_size=n_max
    )
