"""Counter-based per-row random numbers (redwood.sample.random)."""

from __future__ import annotations

import math

import pytest
import torch

from redwood.sample.chain_verify import verify_sampling
from redwood.sample.random import RowRandom, inverse_cdf, mix32


def _mix32_reference(x: int) -> int:
    """The lowbias32-style finalizer in Python integers (exact, no int64 involved)."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x5BD1E995) & m
    return x ^ (x >> 16)


def test_mix32_matches_exact_integer_reference_over_the_whole_word_range():
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFE, 0xFFFFFFFF]
    xs += torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    got = mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [_mix32_reference(x) for x in xs]
    assert all(0 <= g < 2**32 for g in got)


def test_uniforms_in_range_fresh_per_draw_and_reproducible():
    a, b = RowRandom([5, 6], "cpu"), RowRandom([5, 6], "cpu")
    u1, u2 = a.uniform(None, (1000,)), a.uniform(None, (1000,))
    assert u1.shape == (2, 1000) and u1.dtype == torch.float32
    assert (u1 >= 0).all() and (u1 < 1).all()
    assert not torch.equal(u1, u2)  # the counter advanced: fresh numbers
    assert not torch.equal(u1[0], u1[1])  # rows differ
    assert torch.equal(b.uniform(None, (1000,)), u1) and torch.equal(b.uniform(None, (1000,)), u2)
    d = RowRandom([5], "cpu").uniform(None, (4000,), torch.float64)
    assert d.dtype == torch.float64 and (d >= 0).all() and (d < 1).all()
    # 53 random bits: the float64 values are not just float32 values widened
    assert (d * 2**24 != torch.floor(d * 2**24)).float().mean() > 0.99
    with pytest.raises(ValueError):
        RowRandom([1], "cpu").uniform(None, (3,), torch.float16)


def test_a_rows_numbers_do_not_depend_on_the_rest_of_the_batch():
    alone = RowRandom([42], "cpu")
    batch = RowRandom([7, 42, 9], "cpu")
    for _ in range(3):
        # items of row 42: two nodes in the batch of three rows, interleaved with other rows' items
        rows_b = torch.tensor([0, 1, 1, 2, 0])
        ub = batch.uniform(rows_b, (50,))
        ua = alone.uniform(torch.tensor([0, 0]), (50,))
        assert torch.equal(ub[1], ua[0]) and torch.equal(ub[2], ua[1])
        assert not torch.equal(ub[1], ub[2])  # two items of one row: different lanes


def test_uniforms_are_uniform_and_independent_of_lane_and_element():
    r = RowRandom([123], "cpu")
    u = r.uniform(torch.zeros(64, dtype=torch.long), (4096,))  # 262,144 numbers
    bins = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = float(((bins - expected) ** 2 / expected).sum())
    assert chi2 < 120.1  # χ²(63) upper 0.001 point ≈ 103.4; some slack
    # neighbouring elements and lanes are uncorrelated
    for x, y in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        c = torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1]
        assert abs(float(c)) < 0.01
    assert abs(float(u.mean()) - 0.5) < 0.003


def test_checkpoint_undo_replays_the_same_numbers():
    r = RowRandom([1, 2], "cpu")
    r.uniform(None, (3,))
    undo = r.checkpoint()
    first = r.uniform(None, (8,))
    undo()
    assert torch.equal(r.uniform(None, (8,)), first)
    c = r.copy()
    assert torch.equal(c.uniform(None, (8,)), r.uniform(None, (8,)))


def test_inverse_cdf_never_draws_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([[0.0, 0.49999, 0.5, 0.9999999]] * 2)
    idx = inverse_cdf(probs, u)
    assert set(idx[0].tolist()) <= {1, 3}
    assert ((idx[1] >= 0) & (idx[1] < 5)).all()  # no mass: uniform


def test_chain_rejection_sampling_with_device_random_preserves_the_target():
    """One verification step of γ = 2 over 20,000 rows with counter-based numbers: the first emitted
    token (an accepted draft or the correction) is distributed as p at position 0."""
    V, rows = 6, 20000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    rand = RowRandom(list(range(rows)), "cpu")
    drafts = inverse_cdf(q.repeat(rows, 1), rand.uniform(None, (2,)).reshape(-1)).view(rows, 2)
    accepted, nxt = verify_sampling(p.expand(rows, -1, -1), q.expand(rows, -1, -1), drafts, rand)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=V).double()
    expected = p[0].double() * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.515  # χ²(5) upper 0.001 point


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_draws_equal_cpu_draws():
    cpu, gpu = RowRandom([3, 2**40 + 7], "cpu"), RowRandom([3, 2**40 + 7], "cuda")
    rows = torch.tensor([1, 0, 1])
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(cpu.uniform(rows, (300,), dtype), gpu.uniform(rows, (300,), dtype).cpu())
    assert not math.isnan(float(gpu.uniform(None, (5,)).sum()))


def test_a_rows_counter_advances_only_with_its_own_draws_and_reseed_restarts_it():
    """Per-row counters: a draw that skips a row leaves its stream where it was, and `reseed` gives a
    batch row a new request's stream from its start — as a request admitted to a freed slot needs."""
    alone = RowRandom([42], "cpu")
    batch = RowRandom([7, 42], "cpu")
    first = batch.uniform(None, (5,))
    assert torch.equal(first[1], alone.uniform(None, (5,))[0])
    batch.uniform(torch.tensor([0, 0]), (5,))  # row 0 only (two items): row 1's counter stays
    assert batch.counter.tolist() == [2, 1]
    assert torch.equal(batch.uniform(torch.tensor([1]), (5,))[0], alone.uniform(None, (5,))[0])
    batch.reseed(0, 42)
    assert batch.counter.tolist() == [0, 2]
    assert torch.equal(batch.uniform(torch.tensor([0]), (5,))[0], first[1])  # 42's first draw again


# ------------------------------------------------------------------------------------------ positional numbers


def test_positional_numbers_depend_only_on_seed_and_position():
    """The number at (seed, position) is the same whatever the row's counter, its batch neighbours, its
    batch row, the draws taken before or the other positions asked with it — and the counter stays."""
    positions = torch.tensor([0, 1, 2, 17, 4095, 2**33 + 5])
    alone = RowRandom([42], "cpu").positional(torch.zeros(6, dtype=torch.long), positions)
    batch = RowRandom([7, 9, 42], "cpu")
    batch.uniform(None, (5,), torch.float64)  # draws advance counters …
    batch.uniform(torch.tensor([2, 2]), (3,))
    batch.uniform(torch.tensor([2]), ())  # (row 2: counter 3, odd and even both covered below)
    counters = batch.counter.clone()
    got = batch.positional(torch.full((6,), 2), positions)  # … and do not move positional numbers
    assert torch.equal(got, alone)
    assert torch.equal(batch.counter, counters)  # (never advanced by positional numbers)
    # interleaved with other rows' items, in another order, in a 2-d layout [rows, positions]
    rows = torch.tensor([0, 2, 1, 2])
    grid = batch.positional(rows, torch.stack([positions.flip(0)] * 4))
    assert torch.equal(grid[1], alone.flip(0)) and torch.equal(grid[3], alone.flip(0))
    # a new request in the slot: its own seed's numbers; another seed's are different
    batch.reseed(0, 42)
    assert torch.equal(batch.positional(torch.zeros(6, dtype=torch.long), positions), alone)
    other = RowRandom([43], "cpu").positional(None, positions[:1])
    assert not torch.equal(other, alone[:1])
    assert alone.dtype == torch.float64 and ((alone >= 0) & (alone < 1)).all()
    assert len(set(alone.tolist())) == 6  # every position its own number


def test_positional_numbers_are_uniform_and_unrelated_to_the_counter_streams():
    """4,096 seeds × 256 positions: uniform (χ² over 64 bins), 53 random bits, neighbouring positions and
    seeds uncorrelated, and uncorrelated with the same rows' counter streams read at counter = position
    (and never equal to any of their numbers: a shared hash domain would show as equal values)."""
    seeds, P = 4096, 256
    r = RowRandom(list(range(seeds)), "cpu")
    u = r.positional(None, torch.arange(P).expand(seeds, P))  # [seeds, P]
    bins = torch.histc(u.float(), bins=64, min=0, max=1)
    expected = u.numel() / 64
    assert float(((bins - expected) ** 2 / expected).sum()) < 120.1
    assert (u * 2**24 != torch.floor(u * 2**24)).double().mean() > 0.99  # not float32 values widened
    counter = torch.cat([r.uniform(None, (1,), torch.float64) for _ in range(P)], dim=1)  # [seeds, P]
    for x, y in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, counter), (u[:, 1:], counter[:, :-1])):
        c = torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1]
        assert abs(float(c)) < 0.005
    assert not bool(torch.isin(u.flatten(), counter.flatten()).any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_positional_numbers_equal_cpu_numbers():
    cpu, gpu = RowRandom([3, 2**40 + 7], "cpu"), RowRandom([3, 2**40 + 7], "cuda")
    rows, positions = torch.tensor([1, 0, 1]), torch.tensor([[0, 5], [9, 2**35], [7, 7]])
    assert torch.equal(cpu.positional(rows, positions), gpu.positional(rows.cuda(), positions.cuda()).cpu())
