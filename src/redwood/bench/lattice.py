"""Bisection over the grid of uniforms a random draw can take: exact probabilities, no sampling.

`RowRandom` draws float32 uniforms k · 2^-24 and float64 uniforms k · 2^-53 (k an integer). A decision
that is monotone in its uniform (an acceptance test, an inverse-CDF draw) changes outcome at grid points;
`first_true` finds them by bisection through the code itself, so the measure of every outcome — the exact
probability the code gives it — is a difference of grid indices over 2^bits. Used by the exactness tests
of the verifiers (`tests/speculation/test_verifiers_exact.py`), of the inverse CDF
(`tests/engine/test_random_streams.py`) and `benchmarks/inverse_cdf_bias.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
