"""Statistical tests of RowRandom's streams, in the layouts the speculative step reads them (issue 16, item 3).

In one step a row draws its draft tokens (one `uniform` call per draft level: a chain level is
`uniform(rows, (1,))`, a tree level `uniform(rows of its T nodes, (k,))` or, drawing without replacement,
`(V,)`), then the verifier's uniforms (chain: `uniform(rows, (γ + 1,))`, γ acceptance tests then the
correction / bonus draw; tree: `uniform(rows, (2, n))`); the next step continues with the next counters.
Speculative sampling is exact only if all those uniforms are independent, so the tests check:

- every axis of a stream (counters, lanes, elements, rows with consecutive seeds): uniform marginals
  (also in the low bits), serial pairs, lagged correlations;
- the exact chain and tree step layouts: every pair of uniforms a step reads (and the next step's first
  draws), by correlation and joint χ²;
- rows whose seeds are consecutive, differ in one bit, or differ in the high 32 bits;
- the items' streams: no more coincidences than 53 random bits give, and no aliasing of (counter,
  lane), float64 uniforms with 53 random bits, no overlapping element blocks, distinct streams for
  seeds that used to share a key (regressions: four defects these tests found in the one-word hash);
- `inverse_cdf`: the exact probability each token gets for float32 and float64 uniforms (by bisection
  on the uniforms' grid, through the function itself), against its true probability.

Statistics. Each test draws a fixed seed set (deterministic), computes exact p-values (`redwood.bench.stats`:
χ² tails; correlations: the standardized cross product 12·Σ(x−½)(y−½)/√n, N(0, 1) for independent
uniforms) and fails if the smallest one is below 1e-4 / (number of p-values): a false alarm
rate ≤ 1e-4 per test (the thresholds are z = 4.4–5.2). Power: the axis and chain tests correlate
~4·10^6 pairs (a correlation of 3e-3 gives z ≈ 6), the tree tests 2·10^6 (4e-3: z ≈ 5.7); each seed
relation 6.6·10^4 pairs (3e-2: z ≈ 7.7) and all 68 pooled 4.5·10^6 (3e-3: z ≈ 6.4).
"""

from __future__ import annotations

import math

import pytest
import torch

from redwood.bench.stats import chi2_sf, first_true, grid_uniform, normal_p, poisson_upper
from redwood.sample.chain_verify import verify_sampling
from redwood.sample.random import RowRandom, inverse_cdf
from redwood.sample.sampler import Sampler, probabilities
from redwood.sample.tree_verify import draw_children, verify_tree_paths
from redwood.sampling_params import SamplingParams

ALPHA = 1e-4  # false-alarm probability per test
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


# ------------------------------------------------------------------------------------------ statistics


def counts_chi2_p(counts: torch.Tensor) -> float:
    """χ² p-value of counts against equal cell probabilities."""
    counts = counts.double().flatten()
    e = counts.sum() / counts.numel()
    return chi2_sf(float(((counts - e) ** 2).sum() / e), counts.numel() - 1)


def uniform_p(x: torch.Tensor, bins: int = 256) -> float:
    """χ² of the marginal of uniforms over `bins` equal cells."""
    return counts_chi2_p(torch.bincount(cell(x, bins).flatten(), minlength=bins))


def cell(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Cell index of uniforms in [0, 1) (bins a power of two: x · bins is exact, below bins)."""
    return (x * bins).long()


def joint_p(*xs: torch.Tensor, bins: int = 16) -> float:
    """χ² of the joint cell counts of independent-pair (or triple) uniforms against the product of
    uniform marginals: bins^d − 1 degrees of freedom."""
    idx = cell(xs[0], bins).flatten()
    for x in xs[1:]:
        idx = idx * bins + cell(x, bins).flatten()
    return counts_chi2_p(torch.bincount(idx, minlength=bins ** len(xs)))


def cross_z(x: torch.Tensor, y: torch.Tensor) -> float:
    """12·Σ(x−½)(y−½)/√n: N(0, 1) for independent uniforms (Pearson's r times √n, with the known
    mean and variance of U[0, 1))."""
    x, y = x.double().flatten() - 0.5, y.double().flatten() - 0.5
    return float(12 * (x * y).sum() / math.sqrt(x.numel()))


def z_matrix(columns: torch.Tensor) -> torch.Tensor:
    """[n, m] uniforms → [m, m] standardized cross products of every pair of columns."""
    c = columns.double() - 0.5
    return 12 * (c.T @ c) / math.sqrt(c.shape[0])


def assert_all_pass(pvalues: dict[str, float]) -> None:
    """Fail if any p-value is below ALPHA / len(pvalues) (Bonferroni: ≤ ALPHA false alarms per test)."""
    threshold = ALPHA / len(pvalues)
    bad = {k: v for k, v in pvalues.items() if v < threshold}
    assert not bad, f"{len(bad)} of {len(pvalues)} p-values below {threshold:.2g}: " + ", ".join(
        f"{k}: {v:.3g}" for k, v in sorted(bad.items(), key=lambda kv: kv[1])[:12]
    )


def low_bits(u: torch.Tensor, dtype: torch.dtype, nbits: int) -> torch.Tensor:
    """The lowest `nbits` mantissa bits a uniform carries (24 for float32, 53 for float64) as uniforms."""
    width = 24 if dtype == torch.float32 else 53
    k = (u.double() * 2.0**width).long()
    return (k & ((1 << nbits) - 1)).double() / 2**nbits


def top32(u: torch.Tensor) -> torch.Tensor:
    """The top 32 bits of float64 uniforms, as int64 words."""
    return (u.double() * 2.0**32).long()


def advance(r: RowRandom, draws: int) -> None:
    """Skip `draws` draws (the counter is a device tensor advanced in place by every draw)."""
    r.counter += draws


def test_advance_equals_drawing():
    a, b = RowRandom([3, 4], "cpu"), RowRandom([3, 4], "cpu")
    for _ in range(5):
        a.uniform(torch.tensor([1, 0, 1]), (7,))
    advance(b, 5)
    assert torch.equal(a.uniform(None, (9,), torch.float64), b.uniform(None, (9,), torch.float64))


# ------------------------------------------------------------------------------------------ the layouts


class Recording(RowRandom):
    """RowRandom that records every draw's (rows, shape, dtype)."""

    def __init__(self, seeds):
        super().__init__(seeds, "cpu")
        self.calls = []

    def uniform(self, rows, shape, dtype=torch.float32):
        self.calls.append((None if rows is None else rows.clone(), tuple(shape), dtype))
        return super().uniform(rows, shape, dtype)


def test_the_consumers_draw_in_the_layouts_these_tests_reproduce():
    """Drafting (draw_children as `_draft` calls it), chain and tree verification and plain sampling call
    `uniform` with exactly the rows and shapes the layout tests below reproduce."""
    B, V, gamma = 3, 11, 3
    g = torch.Generator().manual_seed(0)
    dist = lambda *s: torch.softmax(torch.randn(*s, V, generator=g), -1)  # noqa: E731
    arange = torch.arange(B)
    # chain: one draw per draft level (k = 1), then the verifier's γ + 1
    rec = Recording(list(range(B)))
    q = dist(B, gamma)
    drafts = torch.stack(
        [
            draw_children(q[:, j], 1, rule, rec, arange)[:, 0]
            for j, rule in enumerate(("replacement", "swor", "replacement"))
        ],
        1,
    )
    verify_sampling(dist(B, gamma + 1), q, drafts, rec)
    assert [(c[0].tolist(), c[1]) for c in rec.calls] == [(arange.tolist(), (1,))] * gamma + [
        (arange.tolist(), (gamma + 1,))
    ]
    # tree: level t draws for its T nodes (rows repeated T times) k children each, then (2, n)
    parents = [-1, 0, 0, 1, 1, 2, 2]
    rec = Recording(list(range(B)))
    q_nodes = dist(B, 7)
    kids0 = draw_children(q_nodes[:, 0], 2, "replacement", rec, arange)
    rows1 = arange.repeat_interleave(2)
    kids1 = draw_children(q_nodes[:, 1:3].reshape(-1, V), 2, "replacement", rec, rows1)
    draw_children(q_nodes[:, 1:3].reshape(-1, V), 2, "swor", rec, rows1)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), kids0, kids1.view(B, 4)], 1)
    verify_tree_paths("specinfer", parents, tokens, dist(B, 7), q_nodes, rec)
    got = [(c[0].tolist(), c[1]) for c in rec.calls]
    assert got == [(arange.tolist(), (2,)), (rows1.tolist(), (2,)), (rows1.tolist(), (V,)), (arange.tolist(), (2, 7))]
    assert rec.calls[2][2] == torch.float64  # drawing without replacement: float64 keys
    # plain sampling: one uniform per row (counter noise); none from the counter streams (position noise)
    for noise, calls in (("counter", [(None, ())]), ("position", [])):
        s = Sampler([SamplingParams(temperature=1.0, seed=i) for i in range(B)], torch.device("cpu"), noise)
        s.random = Recording(list(range(B)))
        s.sample(torch.randn(B, V, generator=g), torch.arange(B) + 7)
        assert [(c[0], c[1]) for c in s.random.calls] == calls


# ------------------------------------------------------------------------------------------ the axes


def axis_samples(axis: str, dtype: torch.dtype) -> torch.Tensor:
    """[strands, length] uniforms, consecutive along one axis of the streams (2^22 numbers)."""
    if axis == "counters":  # 2^13 rows, 512 successive draws each
        r = RowRandom(list(range(1 << 13)), "cpu")
        return torch.cat([r.uniform(None, (1,), dtype) for _ in range(512)], 1)
    if axis == "lanes":  # 2^12 rows × 1024 items of one draw
        rows = torch.arange(1 << 12).repeat_interleave(1024)
        return RowRandom(list(range(1 << 12)), "cpu").uniform(rows, (1,), dtype).view(1 << 12, 1024)
    if axis == "elements":  # 2^12 items of 1024 elements
        return RowRandom(list(range(1 << 12)), "cpu").uniform(None, (1024,), dtype)
    if axis == "rows":  # seeds 0, 1, …, 2^18 − 1 side by side, 16 draws
        r = RowRandom(list(range(1 << 18)), "cpu")
        return torch.stack([r.uniform(None, (), dtype) for _ in range(16)])
    raise ValueError(axis)


@DTYPES
@pytest.mark.parametrize("axis", ["counters", "lanes", "elements", "rows"])
def test_uniform_marginals_serial_pairs_and_lags_along_each_axis(axis, dtype):
    u = axis_samples(axis, dtype)  # [strands, length], the axis last
    p = {
        "marginal": uniform_p(u),
        "low byte": uniform_p(low_bits(u, dtype, 8)),
        "pairs (even, odd)": joint_p(u[:, 0::2], u[:, 1::2]),
        "pairs (odd, even)": joint_p(u[:, 1:-1:2], u[:, 2::2]),
        "low-nibble pairs": joint_p(low_bits(u[:, 0::2], dtype, 4), low_bits(u[:, 1::2], dtype, 4)),
        "triples": joint_p(u[:, 0:-2:3], u[:, 1:-1:3], u[:, 2::3], bins=8),
    }
    for lag in (1, 2, 3, 5, 7):
        p[f"lag {lag}"] = normal_p(cross_z(u[:, :-lag], u[:, lag:]))
    assert_all_pass(p)


# ------------------------------------------------------------------------------------------ step layouts


def chain_steps(dtype: torch.dtype, rows: int, steps: int, gamma: int = 3) -> torch.Tensor:
    """[steps, rows, 2γ + 1]: per step the γ draft uniforms (one `uniform(rows, (1,))` per level), the γ
    acceptance uniforms and the correction / bonus uniform (`uniform(rows, (γ + 1,))`)."""
    r = RowRandom(list(range(rows)), "cpu")
    arange = torch.arange(rows)
    out = []
    for _ in range(steps):
        drafts = [r.uniform(arange, (1,), dtype) for _ in range(gamma)]
        out.append(torch.cat(drafts + [r.uniform(arange, (gamma + 1,), dtype)], 1))
    return torch.stack(out)


@DTYPES
def test_chain_step_draft_acceptance_and_correction_uniforms_are_independent(dtype):
    gamma = 3
    u = chain_steps(dtype, rows=1 << 15, steps=128, gamma=gamma)  # 2^22 samples of each of 7 uniforms
    names = [f"draft{j}" for j in range(gamma)] + [f"accept{j}" for j in range(gamma)] + ["correction"]
    # this step's 7 and the next step's 7 uniforms side by side
    both = torch.cat([u[:-1], u[1:]], 2).reshape(-1, 2 * len(names))
    z = z_matrix(both)
    cols = names + [f"next {n}" for n in names]
    p = {
        f"corr {cols[i]} × {cols[j]}": normal_p(float(z[i, j]))
        for i in range(len(names))
        for j in range(i + 1, len(cols))
    }
    flat = u.reshape(-1, len(names))
    col = {n: flat[:, i] for i, n in enumerate(names)}
    for j in range(gamma):
        p[f"joint draft{j} × accept{j}"] = joint_p(col[f"draft{j}"], col[f"accept{j}"])
        p[f"joint accept{j} × correction"] = joint_p(col[f"accept{j}"], col["correction"])
        p[f"joint draft{j} × correction"] = joint_p(col[f"draft{j}"], col["correction"])
        p[f"joint draft{j} × accept{j} × correction"] = joint_p(
            col[f"draft{j}"], col[f"accept{j}"], col["correction"], bins=8
        )
    p["joint correction × next draft0"] = joint_p(u[:-1, :, -1], u[1:, :, 0])
    assert_all_pass(p)


def tree_steps(dtype: torch.dtype, rows: int, steps: int, swor_elements: int | None) -> tuple[torch.Tensor, list[str]]:
    """[steps · rows, m] uniforms of the tree step parents = [-1, 0, 0, 1, 1, 2, 2]: the root draws 2
    children, nodes 1, 2 draw 2 each (one call for both: lanes 0, 1), then the verifier's (2, n).
    swor_elements: draw the levels as without replacement does, `(V,)` per node (its first elements
    kept), instead of `(k,)`."""
    n = 7
    r = RowRandom(list(range(rows)), "cpu")
    arange = torch.arange(rows)
    level_rows = [arange, arange.repeat_interleave(2)]
    shape = (2,) if swor_elements is None else (swor_elements,)
    names = (
        [f"L0 n0 e{e}" for e in range(shape[0])]
        + [f"L1 n{v} e{e}" for v in (1, 2) for e in range(shape[0])]
        + [f"accept child {v}" for v in range(n)]
        + [f"draw at {v}" for v in range(n)]
    )
    out = []
    for _ in range(steps):
        parts = [r.uniform(lr, shape, dtype).view(rows, -1) for lr in level_rows]
        parts.append(r.uniform(arange, (2, n), dtype).view(rows, -1))
        out.append(torch.cat(parts, 1))
    return torch.cat(out), names


@pytest.mark.parametrize(
    "rule, dtype",
    [
        ("replacement", torch.float32),
        ("replacement", torch.float64),
        ("swor", torch.float64),
    ],  # (without replacement: float64 keys)
    ids=["replacement-float32", "replacement-float64", "swor-float64"],
)
def test_tree_step_uniforms_are_independent(rule, dtype):
    u, names = tree_steps(dtype, rows=1 << 14, steps=128, swor_elements=None if rule == "replacement" else 4)
    z = z_matrix(u)
    m = len(names)
    p = {f"corr {names[i]} × {names[j]}": normal_p(float(z[i, j])) for i in range(m) for j in range(i + 1, m)}
    idx = {nm: i for i, nm in enumerate(names)}
    for v in range(1, 7):  # a child's acceptance test against the draw of a sibling / the node's draw
        p[f"joint accept {v} × draw at {v}"] = joint_p(u[:, idx[f"accept child {v}"]], u[:, idx[f"draw at {v}"]])
    for a, b in (
        ("L0 n0 e0", "L0 n0 e1"),
        ("L0 n0 e0", "L1 n1 e0"),
        ("L1 n1 e0", "L1 n2 e0"),
        ("L1 n1 e1", "accept child 3"),
        ("L1 n2 e0", "draw at 0"),
    ):
        p[f"joint {a} × {b}"] = joint_p(u[:, idx[a]], u[:, idx[b]])
    assert_all_pass(p)


# ------------------------------------------------------------------------------------------ seeds


@DTYPES
def test_streams_of_related_seeds_are_independent(dtype):
    """Seeds s and s + 1, s XOR 2^j (each bit j of 63), s + 2^32 and s + 2^32 + 1: the same draws of the two
    rows are uncorrelated (cross product), jointly uniform (16×16 χ²) and agree in half of their bits."""
    g = torch.Generator().manual_seed(1)
    P = 1024
    base = torch.randint(0, 2**62, (P,), generator=g, dtype=torch.long).tolist()
    relations = {"s+1": lambda s: s + 1, "s+2^32": lambda s: s + 2**32, "s+2^32+1": lambda s: s + 2**32 + 1}
    relations |= {f"s^2^{j}": (lambda j: lambda s: s ^ (1 << j))(j) for j in range(63)}
    consecutive = list(range(P))  # also from seed 0, 1, … (the usual seeds)
    pairs = {
        "0..: s+1": (consecutive, [s + 1 for s in consecutive]),
        "0..: s+2^32": (consecutive, [s + 2**32 for s in consecutive]),
    }
    pairs |= {name: (base, [f(s) for s in base]) for name, f in relations.items()}
    seeds = [s for a, b in pairs.values() for s in a + b]
    r = RowRandom(seeds, "cpu")
    u = torch.cat([r.uniform(None, (32,), dtype), r.uniform(None, (32,), dtype)], 1).view(len(pairs), 2, P, -1)
    p, flips = {}, []
    for (name, _), (x, y) in zip(pairs.items(), u):
        p[f"corr {name}"] = normal_p(cross_z(x, y))
        p[f"joint {name}"] = joint_p(x, y)
        same = ~((x * 2**24).long() ^ (y * 2**24).long()) & (2**24 - 1)  # agreeing bits of the top 24
        agree = sum(int(((same >> b) & 1).sum()) for b in range(24))
        n = 24 * x.numel()
        p[f"bits {name}"] = normal_p((agree - n / 2) / math.sqrt(n / 4))
        flips.append(cross_z(x, y))
    assert_all_pass(p)
    # pooled over all 68 relations: 4.5·10^6 pairs, a correlation of 3e-3 would give z ≈ 6.4
    assert abs(sum(flips) / math.sqrt(len(flips))) < 4.4


# ------------------------------------------------------------------------------------------ collisions


def coincidences(words: torch.Tensor) -> int:
    """Number of pairs of equal values."""
    _, counts = torch.unique(words.flatten(), return_counts=True)
    return int((counts * (counts - 1) // 2).sum())


def test_item_streams_coincide_no_more_than_53_random_bits_would():
    """The streams of 2^22 items (256 rows with seeds 0…, 256 draws of 64 lanes each) start with
    float64 uniforms that coincide no more often than 53 random bits would (birthday bound: λ = n²/2^54
    ≈ 0.001, so at most one coincident pair). (With one 32-bit word per item — the hash before the
    two-word fix — ~2,048 pairs coincided, each a whole shared stream.) The rows of one draw never
    coincide at the same lane."""
    R, C, L = 256, 256, 64
    r = RowRandom(list(range(R)), "cpu")
    rows = torch.arange(R).repeat_interleave(L)
    u = torch.stack([r.uniform(rows, (1,), torch.float64)[:, 0] for _ in range(C)])  # [C, R·L]
    n = u.numel()
    assert coincidences(u) <= poisson_upper(n * (n - 1) / 2 / 2**53, ALPHA)
    same_lane = u.view(C, R, L).sort(dim=1).values  # one draw, one lane, all rows
    assert not bool((same_lane[:, 1:] == same_lane[:, :-1]).any())


def test_counter_and_lane_never_alias():
    """Regression (found here; fixed by the two-word item hash). The item word used to hash
    counter·0x10001 + lane mod 2^32, so (counter c + 65535·d, lane l + d) ≡ (c, l): 65535 draws later (a
    long generation: a tree step makes depth + 1 draws) node l + 1 of a draft level got exactly the
    stream node l got at counter c."""
    r = RowRandom([0], "cpu")
    four = torch.zeros(4, dtype=torch.long)  # four nodes of one row: lanes 0–3
    first = r.uniform(four, (8,), torch.float64)
    advance(r, 65535 - 1)
    later = r.uniform(four, (8,), torch.float64)  # counter 65535
    advance(r, 65535 - 1)
    latest = r.uniform(four, (8,), torch.float64)  # counter 131070
    shared = [
        f"lane {b} at counter {c} = lane {a} at counter 0"
        for c, x in ((65535, later), (131070, latest))
        for b in range(4)
        for a in range(4)
        if torch.equal(x[b], first[a])
    ]
    assert not shared, shared


def test_float64_uniforms_carry_53_random_bits():
    """Regression (found here; fixed by the two-word element hash). A float64 uniform used to be
    (h · 2^21 + (mix32(h ^ c) >> 11)) · 2^-53 for the 32-bit word h: its low 21 bits a function of its
    high 32, so only 2^32 float64 uniforms existed (resolution 2^-32, not 2^-53). Among 2^21 items
    (2048 rows × 1024 lanes, one element each) ~511 pairs share the top 32 bits (birthday count); with
    53 random bits their low 21 bits agree in ~2.4e-4 of those pairs (the old hash: in all)."""
    rows = torch.arange(1 << 11).repeat_interleave(1 << 10)
    u = RowRandom(list(range(1 << 11)), "cpu").uniform(rows, (1,), torch.float64).flatten()
    hi = top32(u)
    order = hi.argsort()
    hs, us = hi[order], u[order]
    same_hi = hs[1:] == hs[:-1]
    pairs = int(same_hi.sum())
    assert pairs > 400  # Poisson(511): the test sees enough pairs
    agree = int((us[1:] == us[:-1])[same_hi].sum())
    assert agree <= 1, f"{agree} of {pairs} pairs with equal top 32 bits are equal float64 uniforms"


@pytest.mark.parametrize("seed", [300, 125, 234])
def test_element_streams_of_two_nodes_never_overlap(seed):
    """Regression (found here; fixed by xor-ing the item's second word into every element). Element e
    used to hash item + e·0x9E3779B9 (one 32-bit word), so two items whose words differed by
    k·0x9E3779B9 with |k| < numel read shifted copies of one stream: probability (2·numel − 1)/2^32 per
    pair of items. Drawing without replacement over a vocabulary of 151,936 (Qwen2.5) for a draft level
    of 16 nodes, two nodes of one row shared their exponential keys (token t of one ↔ token t + k of
    the other) in 0.85% of steps. Seeds 300, 125, 234 at counter 0 were such steps (nodes 2 / 7, 9 / 15,
    5 / 13; found by searching seeds 0–2000: 22 such steps, 17 expected). Now no two of the 16 × 151,936
    float64 uniforms of such a draw coincide."""
    V = 151936
    u = RowRandom([seed], "cpu").uniform(torch.zeros(16, dtype=torch.long), (V,), torch.float64)
    values, inverse = torch.unique(u.flatten(), return_inverse=True)
    node = torch.arange(16).repeat_interleave(V)
    first_node = torch.full((values.numel(),), 16).scatter_reduce(0, inverse, node, "amin")
    shared = int((first_node[inverse] != node).sum())  # uniforms also drawn by an earlier node
    assert shared == 0, f"{shared} uniforms of a later node are an earlier node's"


def test_seeds_that_shared_a_key_get_distinct_streams():
    """Regression (found here; fixed by a second key word). The 64-bit seed used to be hashed to one
    32-bit key, mix32(mix32(hi ^ c) ^ lo): seeds 0 and (1 << 32) | (mix32(c) ^ mix32(1 ^ c)) =
    6,054,683,588 got the same key, hence the same numbers everywhere; random 63-bit seeds (seed None)
    collided at the birthday rate of 32 bits (~116 pairs of identical rows among 10^6)."""
    a, b = RowRandom([0, 6054683588], "cpu").uniform(None, (16,), torch.float64)
    assert not bool((a == b).any())


def test_float64_low_bits_are_uniform_and_independent_of_the_high_bits():
    """The 21 bits below a float64 uniform's top 32: uniform (256 cells of their top 8), independent
    of the top bits (16 × 16 joint χ²; correlation), and the uniforms are not float32 values widened."""
    u = RowRandom(list(range(1 << 12)), "cpu").uniform(None, (1 << 10,), torch.float64).flatten()
    low = low_bits(u, torch.float64, 21)
    assert_all_pass(
        {
            "low 21 bits uniform": uniform_p(low),
            "lowest 8 bits uniform": uniform_p(low_bits(u, torch.float64, 8)),
            "high × low joint": joint_p(u, low),
            "high × low corr": normal_p(cross_z(u, low)),
            "bits 21-24 × lowest 4": joint_p(low, low_bits(u, torch.float64, 4)),
        }
    )
    assert float((u * 2**24 == torch.floor(u * 2**24)).double().mean()) < 1e-4


# ------------------------------------------------------------------------------------------ inverse_cdf


def exact_token_probabilities(probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact probability with which inverse_cdf(probs [V], u) returns each token, for u uniform
    on the grid of k · 2^-w (w = 24 for float32 uniforms, 53 for float64): bisection (through the function
    itself, monotone in u) for the first grid point at which each token index is reached."""
    w = 24 if dtype == torch.float32 else 53
    V, N = probs.numel(), 1 << w
    target = torch.arange(1, V + 1)  # b_i = first k with inverse_cdf(k · 2^-w) ≥ i, i = 1 … V
    row = probs[None]
    first = first_true(lambda k: inverse_cdf(row, grid_uniform(k, w).to(dtype)[None])[0] >= target, V, w)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), first])
    return (bounds[1:] - bounds[:-1]).double() / N


def sample_distributions():
    """The small test vocabularies and a large-vocabulary sampling distribution."""
    g = torch.Generator().manual_seed(0)
    out = {
        "V=6 softmax(1.5·z)": torch.softmax(torch.randn(6, generator=g) * 1.5, -1),
        "V=5 with zeros": torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]),
        "V=3 tiny token": torch.tensor([0.5, 1e-9, 0.5]),
    }
    z = torch.randn(1, 32768, generator=g) * 2.5
    for t, top_p in ((1.0, 1.0), (0.7, 0.9)):
        out[f"V=32768 N(0, 2.5²) T={t} top-p {top_p}"] = probabilities(
            z, torch.tensor([t]), torch.tensor([0]), torch.tensor([top_p])
        )[0]
    return out


@DTYPES
def test_inverse_cdf_gives_each_token_its_probability_up_to_the_uniforms_spacing(dtype):
    """Exactly (no sampling): every token's probability under inverse_cdf differs from its true
    probability p / Σp by less than the uniforms' grid spacing (2^-24 for float32 uniforms, 2^-53 — up to
    the float64 sums' rounding — for float64), never returns a zero-probability token, and so the
    total variation is at most (support / 2) · spacing."""
    spacing = 2.0**-24 if dtype == torch.float32 else 2.0**-53
    for name, probs in sample_distributions().items():
        got = exact_token_probabilities(probs, dtype)
        true = probs.double() / probs.double().sum()
        err = (got - true).abs()
        support = int((probs > 0).sum())
        bound = spacing * (1 + 1e-6) + (0.0 if dtype == torch.float32 else 64 * support * 2.0**-53)
        assert float(err.max()) <= bound, (name, float(err.max()) / spacing)
        assert float(got[probs == 0].sum()) == 0.0, name
        assert float(err.sum()) / 2 <= support * bound / 2, name
        assert abs(float(got.sum()) - 1) < 1e-12
