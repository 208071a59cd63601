"""The statistics of redwood's distribution tests: χ² tests and quantiles, p-values, multiple testing,
effect sizes, and exact probabilities on the grid of uniforms.

One module for the tests that sample (the verifiers' and samplers' goodness-of-fit tests, the random
streams' battery) and the end-to-end lossless benchmark (`redwood.bench.lossless`,
`benchmarks/lossless_bench.py`), and for the exact checks that do not sample at all (`first_true`).
Only torch is needed (no scipy): the χ² and Poisson tails are regularized incomplete gamma functions.

- Distributions: `chi2_sf` (upper tail of χ²), `chi2_quantile` (its inverse, by bisection) and the
  standard table `CHI2_999`; `normal_p` (two-sided normal tail); `poisson_upper` (a Poisson count's
  upper limit).
- Goodness of fit: `chi2_fit` (counts against exact cell probabilities, small cells pooled by
  `pooled_cells`), `chi2_fit_samples` (the same for cell indices), `chi2_homogeneity` (two samples).
- Many tests at once: `holm` (Holm–Bonferroni). What a sample could see: `effect`.
- The grid of uniforms: `grid_uniform`, `first_true` (below).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

MIN_EXPECTED = 5.0  # χ² cells with a smaller expected count are pooled

# Upper 0.1 % points of χ²(df), df = 1…64 (standard tables; index df, CHI2_999[0] unused).
CHI2_999 = [
    None,
    10.828,
    13.816,
    16.266,
    18.467,
    20.515,
    22.458,
    24.322,
    26.124,
    27.877,
    29.588,
    31.264,
    32.909,
    34.528,
    36.123,
    37.697,
    39.252,
    40.790,
    42.312,
    43.820,
    45.315,
    46.797,
    48.268,
    49.728,
    51.179,
    52.620,
    54.052,
    55.476,
    56.892,
    58.301,
    59.703,
    61.098,
    62.487,
    63.870,
    65.247,
    66.619,
    67.985,
    69.346,
    70.703,
    72.055,
    73.402,
    74.745,
    76.084,
    77.419,
    78.750,
    80.077,
    81.400,
    82.720,
    84.037,
    85.351,
    86.661,
    87.968,
    89.272,
    90.573,
    91.872,
    93.168,
    94.461,
    95.751,
    97.039,
    98.324,
    99.607,
    100.888,
    102.166,
    103.442,
    104.716,
]


def _f64(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ------------------------------------------------------------------------------------------ distributions
def chi2_sf(stat: float, df: int) -> float:
    """P(χ²_df ≥ stat): the regularized upper incomplete gamma function Q(df / 2, stat / 2)."""
    if df <= 0:
        return 1.0
    if math.isinf(stat):
        return 0.0
    return float(torch.special.gammaincc(_f64(df / 2), _f64(stat / 2)))


@functools.cache
def chi2_quantile(df: int, q: float = 0.999) -> float:
    """The q-quantile of χ²(df): bisection on the regularized lower incomplete gamma function."""
    lo, hi = 0.0, 10.0 * df + 100.0
    a = _f64(df / 2)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammainc(a, _f64(mid / 2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def normal_p(z: float) -> float:
    """Two-sided N(0, 1) tail P(|Z| ≥ |z|)."""
    return float(torch.special.erfc(_f64(abs(z) / math.sqrt(2))))


def poisson_upper(lam: float, alpha: float) -> int:
    """Smallest c with P(Poisson(λ) > c) ≤ alpha (P(X > c) = P(Gamma(c + 1) < λ), the regularized lower
    incomplete gamma function)."""
    tail = lambda c: float(torch.special.gammainc(_f64(c + 1.0), _f64(lam)))  # noqa: E731
    lo, hi = 0, int(lam + 20 * math.sqrt(lam) + 50)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if tail(mid) <= alpha else (mid + 1, hi)
    return lo


# ------------------------------------------------------------------------------------------ goodness of fit
def pooled_cells(expected: torch.Tensor, min_expected: float = MIN_EXPECTED) -> torch.Tensor:
    """Cell → group index [C] for χ²: cells of expected count ≥ min_expected stand alone, the rest share
    one pool, grown by the smallest standalone cells while it is below min_expected (ties: the first
    cell). Cells of expected 0 get group −1 (no group)."""
    group = torch.full((expected.numel(),), -1, dtype=torch.long)
    live = (expected > 0).nonzero()[:, 0]
    order = live[expected[live].argsort(stable=True)]  # live cells, smallest expected first
    pooled = int((expected[order] < min_expected).sum())  # the first `pooled` cells of `order` share group 0
    while 0 < expected[order[:pooled]].sum() < min_expected and pooled < len(order):
        pooled += 1
    first = 1 if pooled else 0  # standalone cells are numbered after the pool
    group[order[:pooled]] = 0
    group[order[pooled:]] = torch.arange(first, first + len(order) - pooled)
    return group


def _grouped(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    keep = group >= 0
    return torch.zeros(int(group.max()) + 1 if keep.any() else 0, dtype=torch.float64).index_add_(
        0, group[keep], x[keep].double()
    )


def chi2_fit(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED) -> dict:
    """Goodness of fit of counts [C] to probs [C] (sum 1), cells pooled by `pooled_cells`: dict of the
    statistic `stat`, `df`, the p-value `p` and `forbidden`, the count in cells of probability 0 (any
    → stat ∞, p = 0)."""
    n = float(counts.sum())
    expected = n * probs.double()
    forbidden = int(counts[probs <= 0].sum())
    group = pooled_cells(expected, min_expected)
    obs, exp = _grouped(counts, group), _grouped(expected, group)
    stat = math.inf if forbidden else float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return dict(stat=stat, df=df, p=chi2_sf(stat, df), forbidden=forbidden)


def chi2_fit_samples(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED) -> dict:
    """`chi2_fit` of integer cell indices `samples` (any shape) against cell probabilities `probs` (any
    shape, flattened; normalized here), plus `forbidden_cells`: the cells of probability 0 drawn."""
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel())
    if counts.numel() != probs.numel():
        raise ValueError(f"samples outside the {probs.numel()} cells: up to {counts.numel() - 1}")
    fit = chi2_fit(counts, probs, min_expected)
    fit["forbidden_cells"] = ((probs <= 0) & (counts > 0)).nonzero().flatten().tolist()
    return fit


def chi2_homogeneity(a: torch.Tensor, b: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED) -> dict:
    """Two samples a, b [C] from one distribution? Cells pooled where min(n_a, n_b)·probs < min_expected
    (pooling fixed by the exact distribution, not the data)."""
    na, nb = float(a.sum()), float(b.sum())
    group = pooled_cells(min(na, nb) * probs.double(), min_expected)
    oa, ob = _grouped(a, group), _grouped(b, group)
    total = oa + ob
    keep = total > 0
    oa, ob, total = oa[keep], ob[keep], total[keep]
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    stat = float(((oa - ea) ** 2 / ea).sum() + ((ob - eb) ** 2 / eb).sum())
    df = len(total) - 1
    return dict(stat=stat, df=df, p=chi2_sf(stat, df))


# ------------------------------------------------------------------------------------------ many tests
def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (same order as given)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def effect(counts: torch.Tensor, probs: torch.Tensor) -> dict:
    """Deviation of the empirical distribution from probs, and the TV that noise alone would give."""
    n = float(counts.sum())
    probs = probs.double()
    diff = counts.double() / n - probs
    noise = 0.5 * math.sqrt(2 / math.pi) * float((probs * (1 - probs) / n).sqrt().sum())
    return dict(max_abs=float(diff.abs().max()), tv=0.5 * float(diff.abs().sum()), tv_noise=noise)


# ------------------------------------------------------------------------------------------ the grid of uniforms
# Bisection over the grid of uniforms a random draw can take: exact probabilities, no sampling.
#
# `RowRandom` draws float32 uniforms k · 2^-24 and float64 uniforms k · 2^-53 (k an integer). A decision
# that is monotone in its uniform (an acceptance test, an inverse-CDF draw) changes outcome at grid
# points; `first_true` finds them by bisection through the code itself, so the measure of every outcome —
# the exact probability the code gives it — is a difference of grid indices over 2^bits. Used by the
# exactness tests of the verifiers (`tests/sample/test_verifiers_exact.py`), of the inverse CDF
# (`tests/sample/test_random_streams.py`) and `benchmarks/inverse_cdf_bias.py`.
def grid_uniform(k: torch.Tensor, bits: int = 53) -> torch.Tensor:
    """The uniform at grid index k [any shape] (float64, exact for k < 2^53)."""
    return k.double() * 2.0**-bits


def first_true(pred: Callable[[torch.Tensor], torch.Tensor], rows: int, bits: int = 53) -> torch.Tensor:
    """Per row, the smallest k in [0, 2^bits] with pred(k) true (2^bits: none below it), for pred monotone
    in k (false … false, true … true). pred: k [rows] int64 (always < 2^bits) → [rows] bool; it is called
    once per bisection step (bits + 1 calls), for all rows at once."""
    lo = torch.zeros(rows, dtype=torch.long)
    hi = torch.full((rows,), 1 << bits, dtype=torch.long)  # the answer lies in [lo, hi]
    while bool((lo < hi).any()):
        active = lo < hi
        mid = (lo + hi) // 2
        t = pred(mid)
        hi = torch.where(active & t, mid, hi)
        lo = torch.where(active & ~t, mid + 1, lo)
    return lo
