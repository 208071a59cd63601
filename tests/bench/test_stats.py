"""The statistics shared by the distribution tests and the lossless benchmark (`redwood.bench.stats`)."""

from __future__ import annotations

import math

import pytest
import torch

from redwood.bench import stats as S


# ------------------------------------------------------------------------------------------ χ²
def test_chi2_sf_matches_closed_forms():
    for x in (0.1, 1.0, 4.0, 20.0):
        assert S.chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # df 2: exponential
        assert S.chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
    assert S.chi2_sf(math.inf, 3) == 0.0 and S.chi2_sf(5.0, 0) == 1.0


def test_holm_step_down():
    # sorted p 0.01, 0.02, 0.04, 0.5 → ×4, ×3, ×2, ×1, then running max, capped at 1
    assert S.holm([0.04, 0.01, 0.5, 0.02]) == pytest.approx([0.08, 0.04, 0.5, 0.06])
    assert S.holm([0.3, 0.2]) == pytest.approx([0.4, 0.4])  # 0.2·2, then max(0.4, 0.3)
    assert S.holm([0.9, 0.8]) == [1.0, 1.0]


def test_pooling_and_forbidden_cells():
    expected = torch.tensor([0.0, 1.0, 2.0, 3.0, 50.0, 100.0], dtype=torch.float64)
    group = S.pooled_cells(expected)
    assert group[0] == -1  # probability 0: no group
    assert len(set(group[1:4].tolist())) == 1  # 1 + 2 + 3 = 6 ≥ 5: one pool
    assert len(set(group[1:].tolist())) == 3
    probs = expected / expected.sum()
    assert S.chi2_fit(torch.tensor([0, 1, 2, 3, 50, 100]), probs)["p"] > 0.5
    impossible = S.chi2_fit(torch.tensor([1, 1, 2, 3, 50, 99]), probs)
    assert impossible["forbidden"] == 1 and impossible["p"] == 0.0


def test_chi2_quantiles_match_tables():
    for df, value in enumerate(S.CHI2_999[1:], start=1):
        assert S.chi2_quantile(df) == pytest.approx(value, abs=2e-3)


def test_pooled_pool_joins_the_first_smallest_standalone_cell():
    """A pool below min_expected takes the smallest standalone cell, the first of equal ones."""
    expected = torch.tensor([1.0, 6.0, 2.0, 6.0, 9.0], dtype=torch.float64)
    group = S.pooled_cells(expected)
    assert group[0] == group[2] == group[1] == 0 and len(set(group.tolist())) == 3
    fit = S.chi2_fit_samples(torch.arange(5).repeat_interleave(expected.long()), expected)
    assert fit["df"] == 2 and fit["stat"] == 0.0 and fit["forbidden"] == 0 and fit["forbidden_cells"] == []
    drew_zero = S.chi2_fit_samples(torch.tensor([0, 1]), torch.tensor([0.0, 1.0]))
    assert drew_zero["forbidden"] == 1 and drew_zero["forbidden_cells"] == [0] and math.isinf(drew_zero["stat"])
    with pytest.raises(ValueError):
        S.chi2_fit_samples(torch.tensor([0, 2]), torch.tensor([0.5, 0.5]))


def test_normal_and_poisson_tails():
    assert S.normal_p(0.0) == pytest.approx(1.0) and S.normal_p(-1.96) == pytest.approx(0.05, abs=1e-4)
    c = S.poisson_upper(3.0, 1e-4)
    assert S.poisson_upper(0.0, 1e-4) == 0
    # P(X > c) ≤ α < P(X > c - 1) for X ~ Poisson(3)
    tail = lambda c: 1 - sum(math.exp(-3.0) * 3.0**k / math.factorial(k) for k in range(c + 1))  # noqa: E731
    assert tail(c) <= 1e-4 < tail(c - 1)


def test_first_true_finds_the_grid_threshold():
    thresholds = torch.tensor([0, 1, 12345, 1 << 20])
    k = S.first_true(lambda k: k >= thresholds, 4, bits=20)
    assert k.tolist() == [0, 1, 12345, 1 << 20]
    assert S.grid_uniform(torch.tensor([1 << 52]), 53).item() == 0.5
