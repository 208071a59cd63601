"""The Sequoia DP against brute force, its properties, and hardware-aware selection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from redwood.errors import ConfigError
from redwood.speculation.trees import Tree
from redwood.tuning.acceptance import AcceptanceVector
from redwood.tuning.tree_search import (
    PROFILE_FORMAT,
    LatencyProfile,
    expected_tokens_table,
    load_profile,
    optimal_tree,
    save_profile,
    select_tree,
    solve_tree_dp,
    step_time,
)


def all_trees(n: int):
    """Every tree with n nodes: breadth-first numbering with contiguous children is exactly a
    non-decreasing `parents` with parents[i] < i, so enumerate those sequences."""

    def rec(ps):
        if len(ps) == n:
            yield Tree(tuple(ps))
            return
        i = len(ps)
        for p in range(max(ps[-1], 0), i):
            yield from rec(ps + [p])

    yield from rec([-1])


TREES = {n: list(all_trees(n)) for n in range(1, 8)}


def brute_force(acceptance, n: int, d: int, width: int) -> float:
    vals = [t.expected_tokens(acceptance) for t in TREES[n] if t.max_depth <= d and max(t.num_children) <= width]
    return max(vals) if vals else -math.inf


def test_tree_counts_are_catalan():
    assert [len(TREES[n]) for n in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]


VECTORS = [
    [0.6, 0.2, 0.1],
    [0.5, 0.3],
    [0.9],
    [0.3, 0.3, 0.2, 0.1, 0.05, 0.05],
    [0.2, 0.0, 0.5],  # a zero rank in the middle
    [0.0],
    [[0.8, 0.1], [0.5, 0.3], [0.2, 0.2]],  # per depth
    [[0.1, 0.6, 0.1], [0.7, 0.1, 0.1]],  # per depth, rank 2 better at depth 1
]


@pytest.mark.parametrize("acceptance", VECTORS)
def test_dp_equals_brute_force(acceptance):
    width = len(acceptance[0]) if isinstance(acceptance[0], list) else len(acceptance)
    dp = solve_tree_dp(acceptance, 7, 7)
    for n in range(1, 8):
        for d in range(1, 8):
            want = brute_force(acceptance, n, d, width)
            got = dp.results[n, d]
            if math.isinf(want):
                assert math.isinf(got) and got < 0, (n, d)
                continue
            assert got == pytest.approx(want, abs=1e-12), (n, d)
            t = dp.tree(n, d)
            assert t.size == n and t.max_depth <= d and max(t.num_children) <= width
            assert t.expected_tokens(acceptance) == pytest.approx(got, abs=1e-12)


def test_zero_padding_makes_every_size_feasible_and_matches_brute_force():
    p = [0.55, 0.25, 0.1] + [0.0] * 6
    table = expected_tokens_table(p, 7, 7)
    for n in range(1, 8):
        for d in range(2, 8):
            assert table[n, d] == pytest.approx(brute_force(p, n, d, 9), abs=1e-12)


def test_table_shape_and_infeasible_cells():
    t = expected_tokens_table([0.5, 0.3], 6, 3)
    assert t.shape == (7, 4)
    assert np.all(np.isneginf(t[0])) and np.all(np.isneginf(t[:, 0]))
    assert t[1, 1] == 1.0 and np.all(np.isneginf(t[2:, 1]))
    assert np.isneginf(t[4, 2])  # W = 2: at most 3 nodes in 2 levels
    assert np.isfinite(t[6, 3]) and np.isfinite(t[5, 3])  # up to 1 + 2 + 4 nodes fit in 3 levels


def test_hand_computed_small_case():
    # p = (0.5, 0.3): by hand
    #   n=2: root + rank-1 child          1 + .5              = 1.5
    #   n=3, d=2: root + both children    1 + .5 + .3         = 1.8   (chain: 1.75)
    #   n=4, d=3: + a child under node 1  1.8 + .5·.5         = 2.05  (under node 2: 1.95)
    #   n=4, d=4: chain 1 + .5 + .25 + .125 = 1.875 < 2.05
    #   n=5, d=3: + rank-2 child under 1  2.05 + .5·.3        = 2.2   (vs under 2: 2.05 + .15 equal)
    t = expected_tokens_table([0.5, 0.3], 5, 4)
    assert t[2, 2] == pytest.approx(1.5)
    assert t[3, 2] == pytest.approx(1.8)
    assert t[3, 3] == pytest.approx(1.8)
    assert np.isneginf(t[4, 2])
    assert t[4, 3] == pytest.approx(2.05)
    assert t[4, 4] == pytest.approx(2.05)
    assert t[5, 3] == pytest.approx(2.2)
    tree, e = optimal_tree([0.5, 0.3], 4, 3)
    assert tree.parents == (-1, 0, 0, 1) and e == pytest.approx(2.05)


def power_law(width: int, p1: float = 0.6, alpha: float = 1.5, total: float = 0.9) -> list[float]:
    raw = [k**-alpha for k in range(1, width + 1)]
    rest = [r / sum(raw[1:]) * (total - p1) for r in raw[1:]]
    return [p1] + rest


def test_monotone_in_size_and_depth():
    t = expected_tokens_table(power_law(8), 200, 10)
    for d in range(1, 11):
        col = t[1:, d]
        fin = col[np.isfinite(col)]
        assert np.all(np.diff(fin) >= -1e-12)
        capacity = sum(8**j for j in range(d))  # W = 8 ranks: 1 + 8 + 64 + ... nodes fit in d levels
        assert len(fin) == min(200, capacity)
    for n in range(1, 201):
        row = t[n, 1:]
        fin = row[np.isfinite(row)]
        assert np.all(np.diff(fin) >= -1e-12)


def test_trees_beat_chains_and_keep_growing():
    p = power_law(32)
    dp = solve_tree_dp(p, 513, 16)
    # the best k independent chains within the budget
    best_chains = max(
        Tree.k_chains(k, L).expected_tokens(p) for k in range(1, 33) for L in range(1, 17) if 1 + k * L <= 513
    )
    # k chains can never beat 1 + Σ_k p_k / (1 - p_1): each chain continues with rank-1 children only
    bound = 1 + sum(p) / (1 - p[0])
    assert best_chains <= bound
    tree_val = dp.results[513, 16]
    assert tree_val > best_chains * 1.2
    # the optimal tree keeps growing with n (roughly logarithmically): every doubling adds tokens
    vals = [dp.results[n, 16] for n in (16, 32, 64, 128, 256, 512)]
    gains = np.diff(vals)
    assert np.all(gains > 0.05)
    # and every tree is at least as good as the chains of the same size
    for k, L in ((4, 4), (8, 8), (32, 15)):
        n = 1 + k * L
        assert dp.results[n, L + 1] >= Tree.k_chains(k, L).expected_tokens(p) - 1e-12


def test_chain_is_optimal_when_only_rank_one_accepts():
    dp = solve_tree_dp([0.7], 9, 12)
    assert dp.tree(9, 12) == Tree.chain(8)
    assert dp.results[9, 12] == pytest.approx(sum(0.7**k for k in range(9)))


def test_per_depth_equal_rows_match_flat_and_vector_input():
    p = [0.6, 0.2, 0.1]
    flat = expected_tokens_table(p, 40, 6)
    assert np.array_equal(expected_tokens_table([p, p, p], 40, 6), flat)
    vec = AcceptanceVector.from_values([0.5, 0.2, 0.1], per_depth=[p, [0.3, 0.2, 0.1]])
    with_rows = expected_tokens_table(vec, 40, 6)
    without = expected_tokens_table(vec, 40, 6, use_per_depth=False)
    assert np.array_equal(without, expected_tokens_table([0.5, 0.2, 0.1], 40, 6))
    assert not np.array_equal(with_rows, without)
    tree, e = optimal_tree(vec, 40, 6)
    assert tree.expected_tokens([p, [0.3, 0.2, 0.1]]) == pytest.approx(e, abs=1e-12)


@pytest.mark.parametrize("acceptance", [power_law(16), [power_law(8, 0.7), power_law(8, 0.5), power_law(8, 0.4)]])
def test_reconstructed_trees_match_table_on_a_larger_range(acceptance):
    dp = solve_tree_dp(acceptance, 150, 9)
    for n in (2, 3, 10, 33, 64, 100, 150):
        for d in (2, 3, 5, 9):
            v = dp.results[n, d]
            if not np.isfinite(v):
                continue
            t = dp.tree(n, d)
            assert t.size == n and t.max_depth <= d
            assert t.expected_tokens(acceptance) == pytest.approx(v, abs=1e-9)
            assert dp.level_widths(n, d) == t.level_widths


def test_optimal_tree_meta_and_budget_that_does_not_fit():
    tree, e = optimal_tree([0.8], 10, 3)  # W = 1, 3 levels: a 3-node chain is the most that fits
    assert tree == Tree.chain(2) and e == pytest.approx(1 + 0.8 + 0.64)
    vec = AcceptanceVector.from_values([0.6, 0.2], models={"target": "T", "draft": "D"}, temperature=0.6)
    tree, e = optimal_tree(vec, 12, 5)
    assert tree.size == 12
    m = tree.meta
    assert m["budget"] == 12 and m["max_depth"] == 5 and m["expected_tokens"] == pytest.approx(e)
    assert AcceptanceVector.from_dict(m["acceptance"]) == vec
    assert m["models"] == {"target": "T", "draft": "D"} and m["temperature"] == 0.6
    # a plain list is recorded as a manual vector too
    assert optimal_tree([0.5], 3, 3)[0].meta["acceptance"]["values"] == [0.5]


@pytest.mark.parametrize(
    "args, message",
    [
        (([0.5], 0, 3), "budget"),
        (([0.5], 3, 0), "max depth"),
        (([-0.5], 3, 3), "negative"),
        (([0.7, 0.7], 3, 3), "sums to"),
        (("0.5", 3, 3), "acceptance"),
    ],
)
def test_dp_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        solve_tree_dp(*args)


# ---------------------------------------------------------------------- profiles and selection
DEMO = LatencyProfile(
    target_tokens=(1, 2, 4, 8, 16, 32), target_ms=(10, 10, 10, 12, 14, 18), draft_width=(1,), draft_ms=(0.3,)
)


def test_demo_config_reproduces_the_chain_and_2_05x():
    """The original's demo config (budgets [1,2,4,8,16,32], target [10,10,10,12,14,18] ms, draft
    0.3 ms) selects a 4-node chain at 2.05x. Its vector file is not available; a 4-chain with 2.05x
    needs 1 + p1 + p1² + p1³ = 2.05 · 11.2 / 10, i.e. p1 ≈ 0.6355, and small higher ranks keep the chain
    optimal. This checks the τ rule (d · t_draft + t_target(n)) / E and speedup t_target(1) / τ."""
    sel = select_tree([0.6355, 0.06, 0.03, 0.02], DEMO, 32, 8, sizes="measured")
    assert (sel.best.size, sel.best.depth) == (4, 4)
    assert sel.tree == Tree.chain(3)
    assert sel.best.draft_ms == pytest.approx(4 * 0.3)
    assert sel.best.speedup == pytest.approx(2.05, abs=0.005)
    assert sel.tree.meta["selected"]["size"] == 4 and "profile" in sel.tree.meta


def synthetic_profile() -> LatencyProfile:
    sizes = (1, 2, 4, 8, 16, 24, 32, 48)
    return LatencyProfile(
        target_tokens=sizes,
        target_ms=tuple(20 + 0.4 * n + 0.004 * n * n for n in sizes),
        draft_width=(1, 4, 8, 16, 32),
        draft_ms=(1.0, 1.2, 1.5, 2.5, 4.0),
        overhead_tokens=(1, 48),
        overhead_ms=(0.2, 1.0),
    )


@pytest.mark.parametrize("acceptance", [power_law(8), [0.75, 0.1, 0.05], [power_law(6, 0.7), power_law(6, 0.4)]])
def test_selection_picks_the_tau_minimising_pair(acceptance):
    prof = synthetic_profile()
    sel = select_tree(acceptance, prof, 48, 8, top=4)
    dp = solve_tree_dp(acceptance, 48, 8)
    taus = {}
    for n in range(1, 49):
        for d in range(1, 9):
            if not np.isfinite(dp.results[n, d]):
                continue
            t = dp.tree(n, d)
            if max(t.level_widths) > prof.max_width:
                continue
            dr = sum(prof.draft(w) for w in t.level_widths[:-1]) + prof.draft(1)
            taus[(n, t.max_depth)] = (dr + prof.target(n) + prof.overhead(n)) / dp.results[n, d]
    best = min(taus.values())
    assert sel.best.tau_ms == pytest.approx(best, rel=1e-12)
    assert taus[(sel.best.size, sel.best.depth)] == pytest.approx(best, rel=1e-12)
    assert sel.best.speedup == pytest.approx(prof.target(1) / best)
    assert [c.tau_ms for c in sel.candidates] == sorted(c.tau_ms for c in sel.candidates)
    assert len(sel.candidates) == 4
    assert sel.candidates[1].tau_ms == pytest.approx(sorted(taus.values())[1], rel=1e-12)
    assert sel.tree.size == sel.best.size and sel.tree.max_depth == sel.best.depth
    assert sel.tree.expected_tokens(acceptance) == pytest.approx(sel.best.expected, abs=1e-9)


def test_selection_respects_profile_ranges():
    prof = LatencyProfile(target_tokens=(1, 8, 16), target_ms=(10, 11, 13), draft_width=(1, 2), draft_ms=(1, 1.1))
    sel = select_tree(power_law(8), prof, 64, 6)
    assert sel.max_size == 16 and sel.tree.size <= 16
    assert max(sel.tree.level_widths) <= 2
    assert sel.skipped_wide > 0


def test_step_time_and_interpolation():
    prof = synthetic_profile()
    assert prof.target(3) == pytest.approx((prof.target(2) + prof.target(4)) / 2)
    assert prof.draft(6) == pytest.approx(1.35)
    assert prof.overhead(24) == pytest.approx(0.2 + 0.8 * 23 / 47)
    dr, tg, ov = step_time(prof, (1, 4, 8, 2), 15)
    assert dr == pytest.approx(1.0 + 1.2 + 1.5 + 1.0)
    with pytest.raises(ConfigError, match="outside the measured range"):
        prof.target(49)
    with pytest.raises(ConfigError, match="outside the measured range"):
        prof.draft(33)
    assert DEMO.draft(500) == 0.3  # one draft point: width-independent


def test_profile_round_trip_and_errors(tmp_path):
    prof = synthetic_profile()
    path = save_profile(prof, tmp_path / "p.json")
    assert load_profile(path) == prof
    flat = LatencyProfile(target_tokens=(1, 2), target_ms=(1, 2), draft_width=(1,), draft_ms=(0.1,), overhead_ms=0.5)
    assert load_profile(save_profile(flat, tmp_path / "f.json")).overhead(7) == 0.5
    good = prof.to_dict()
    bad_cases = [
        ({**good, "format": "x"}, "format"),
        ({**good, "target": {"tokens": [2, 4], "ms": [1, 2]}}, "at 1 token"),
        ({**good, "target": {"tokens": [1, 4, 2], "ms": [1, 2, 3]}}, "strictly increasing"),
        ({**good, "target": {"tokens": [1, 2], "ms": [1]}}, "equal length"),
        ({**good, "draft": {"width": [1, 2], "ms": [1, -2]}}, "non-negative"),
        ({**good, "draft": {"width": [2], "ms": [1]}}, "width 1"),
        ({k: v for k, v in good.items() if k != "draft"}, "missing 'draft'"),
        ({**good, "overhead": "lots"}, "overhead"),
    ]
    import json

    for d, message in bad_cases:
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(d))
        with pytest.raises(ConfigError, match=message):
            load_profile(p)
    assert good["format"] == PROFILE_FORMAT
    with pytest.raises(ConfigError, match="not found"):
        load_profile(tmp_path / "nope.json")
