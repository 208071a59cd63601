"""Exact bias of `inverse_cdf` from the uniforms' resolution (issue 16, item 3): float32 vs float64.

For a distribution p over V tokens, `inverse_cdf(p, u)` returns token i on a set of u; its probability
under the uniforms actually fed is computed exactly, not by sampling. `inverse_cdf` is monotone in u, so
bisection over the grid of possible u (through the function itself, V boundaries at once) gives, for
every token, the first grid point that reaches it, and the token's probability is the number of grid
points between two boundaries over the grid size. Columns:

  f32        float32 uniforms (RowRandom's: k · 2^-24, k < 2^24), the current inverse_cdf
  f64 ideal  float64 uniforms on the full 53-bit grid (k · 2^-53), the current inverse_cdf
  f64 2^32   float64 uniforms on a 2^32-point lattice, (h · 2^21 + g(h)) · 2^-53 for the 32-bit word h,
             g(h) = mix32(h ^ 0x68BC21EB) >> 11 — one point in each 2^-32 cell: RowRandom's float64
             uniforms before the two-word hash (their low 21 bits were a function of the high 32; exact
             count per token from the 53-bit boundaries: the cells below, plus the boundary cell's
             point if it lies below). The table says whether RowRandom still draws on this lattice.
  f32 sums   float32 uniforms and float32 cumulative sums (`inverse_cdf` before the float64 change)

against the true probability p_i / Σ p (float64 sums of the float32 probabilities). Reported per
distribution: the largest absolute error (also in units of 2^-24), the largest relative error among
tokens with p ≥ 1e-4 and with p ≥ 1e-6 (the probabilities a test of 10^6–10^8 samples resolves), the
total variation ½ Σ |P − p|, and the mass of the tokens with p > 0 that are never drawn.

Distributions: softmax of random logits over V = 32,000 / 49,152 / 151,936 (Gaussian logits with σ = 2
and 4; a Zipf-like law p ∝ (rank + 2.7)^-1.1 in random order), through `redwood.sample.sampler.
probabilities` at T = 1, T = 0.7 and T = 0.7 with top-p 0.9; and the small-vocabulary distributions of
the tests (V = 6, softmax(1.5 z) at T = 0.5 / 1 / 1.5).

    ./.venv/bin/python benchmarks/inverse_cdf_bias.py --out benchmarks/results/random-battery/inverse_cdf_bias.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from redwood.bench.stats import first_true, grid_uniform
from redwood.sample.random import RowRandom, inverse_cdf, mix32
from redwood.sample.sampler import probabilities

LOW21 = (1 << 21) - 1
SALT2 = 0x68BC21EB


def inverse_cdf_float32_sums(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf as it was before the float64 change (float32 cumulative sums and product)."""
    u = u[:, None] if u.dim() == 1 else u
    mass = probs.sum(-1, keepdim=True)
    probs = torch.where(mass > 0, probs, torch.ones_like(probs))
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u.float() * cdf[:, -1:]).contiguous(), right=True)
    V = probs.shape[-1]
    last = (V - 1) - (probs > 0).flip(-1).float().argmax(-1, keepdim=True)
    return torch.minimum(idx, last)


def boundaries(fn, probs: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """b_i (i = 0 … V): the first k in [0, 2^bits] with fn(probs, k · 2^-bits) ≥ i (2^bits if none)."""
    V = probs.numel()
    target = torch.arange(1, V + 1)
    row = probs[None]
    first = first_true(lambda k: fn(row, grid_uniform(k, bits).to(dtype)[None])[0] >= target, V, bits)
    return torch.cat([torch.zeros(1, dtype=torch.long), first])


def lattice_below(b: torch.Tensor) -> torch.Tensor:
    """Number of RowRandom float64 lattice points (h · 2^21 + g(h), h < 2^32) below b (on the 2^53 grid)."""
    H = b >> 21
    inside = H < (1 << 32)
    g = mix32((H.clamp(max=(1 << 32) - 1)) ^ SALT2) >> 11
    return torch.where(inside, H + (g < (b & LOW21)).long(), torch.full_like(H, 1 << 32))


def check_lattice_model() -> bool:
    u = RowRandom(list(range(64)), "cpu").uniform(None, (4096,), torch.float64).flatten()
    k = (u * 2.0**53).long()
    return bool(((k & LOW21) == (mix32((k >> 21) ^ SALT2) >> 11)).all())


def measures(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    b = boundaries(inverse_cdf, probs, 24, torch.float32)
    out["f32"] = (b[1:] - b[:-1]).double() / 2**24
    b = boundaries(inverse_cdf, probs, 53, torch.float64)
    out["f64 ideal"] = (b[1:] - b[:-1]).double() / 2**53
    c = lattice_below(b)
    out["f64 2^32"] = (c[1:] - c[:-1]).double() / 2**32
    b = boundaries(inverse_cdf_float32_sums, probs, 24, torch.float32)
    out["f32 sums"] = (b[1:] - b[:-1]).double() / 2**24
    return out


def stats(P: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    p = probs.double() / probs.double().sum()
    err = (P - p).abs()
    rel = lambda floor: float((err[p >= floor] / p[p >= floor]).max()) if bool((p >= floor).any()) else 0.0  # noqa: E731
    return {
        "max abs": float(err.max()),
        "max abs / 2^-24": float(err.max()) * 2**24,
        "rel p≥1e-4": rel(1e-4),
        "rel p≥1e-6": rel(1e-6),
        "TV": float(err.sum()) / 2,
        "never drawn mass": float(p[(P == 0) & (p > 0)].sum()),
    }


def distributions(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    settings = ((1.0, 1.0), (0.7, 1.0), (0.7, 0.9))
    for V in (32000, 49152, 151936):
        fams = {"gauss σ=2": torch.randn(V, generator=g) * 2, "gauss σ=4": torch.randn(V, generator=g) * 4}
        zipf = -1.1 * torch.log(torch.arange(V, dtype=torch.float64) + 2.7)
        fams["zipf 1.1"] = zipf[torch.randperm(V, generator=g)].float()
        for fam, logits in fams.items():
            for t, top_p in settings:
                yield (
                    f"V={V} {fam} T={t} top-p {top_p}",
                    probabilities(logits[None], torch.tensor([t]), torch.tensor([0]), torch.tensor([top_p]))[0],
                )
    z = torch.randn(6, generator=g) * 1.5
    for t in (0.5, 1.0, 1.5):
        yield (
            f"V=6 softmax(1.5z) T={t}",
            probabilities(z[None], torch.tensor([t]), torch.tensor([0]), torch.tensor([1.0]))[0],
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the tables (markdown) here")
    args = ap.parse_args()
    lattice = check_lattice_model()
    cols = ["f32", "f64 ideal", "f64 2^32", "f32 sums"]
    keys = ["max abs / 2^-24", "rel p≥1e-4", "rel p≥1e-6", "TV", "never drawn mass"]
    rows = {c: [] for c in cols}
    worst = {(k, c): 0.0 for k in keys for c in cols}
    for name, probs in distributions():
        P = measures(probs)
        p = probs.double() / probs.double().sum()
        head = f"| {name} | {int((probs > 0).sum())} | {float(p[p < 2**-24].sum()):.3g} | "
        for c in cols:
            s = stats(P[c], probs)
            for k in keys:
                worst[k, c] = max(worst[k, c], s[k])
            rows[c].append(head + " | ".join(f"{s[k]:.3g}" for k in keys) + " |")
        print(name, " ".join(f"{c}: TV {stats(P[c], probs)['TV']:.3g}" for c in cols), flush=True)
    lines = [
        "# inverse_cdf: exact token probabilities under the uniforms fed to it",
        "",
        f"Command: `./.venv/bin/python benchmarks/inverse_cdf_bias.py {' '.join(sys.argv[1:])}`",
        "",
        "Exact (bisection over every grid of uniforms, through the function itself); see the script's "
        "docstring for the columns. RowRandom's float64 uniforms now "
        + (
            "lie on the 2^32-point lattice (column f64 2^32)."
            if lattice
            else "carry 53 random bits (column f64 ideal); f64 2^32 is what they were before the two-word hash."
        ),
        "",
        "## Worst over all distributions",
        "",
        "| measure | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{worst[k, c]:.3g}" for c in cols) + " |")
    titles = {
        "f32": "float32 uniforms (2^24 grid), current inverse_cdf (float64 sums)",
        "f64 ideal": "float64 uniforms on the full 2^53 grid, current inverse_cdf",
        "f64 2^32": "float64 uniforms on the 2^32-point lattice (RowRandom's before the two-word hash)",
        "f32 sums": "float32 uniforms, inverse_cdf with float32 sums (before the float64 change)",
    }
    for c in cols:
        lines += [
            "",
            f"## {c}: {titles[c]}",
            "",
            "| distribution | support | mass of p < 2^-24 | " + " | ".join(keys) + " |",
            "|---" * (3 + len(keys)) + "|",
        ] + rows[c]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
