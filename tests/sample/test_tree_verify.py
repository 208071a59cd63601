"""Tree verifiers and child-drawing rules (redwood.sample.tree_verify).

Distribution tests are χ² goodness-of-fit tests at the 0.1 % level (the standard table
`redwood.bench.stats.CHI2_999`), over many independent rows per call — every row with its own seeded
verifier generator, so each test is deterministic. Target and draft distributions go through `redwood.sample.sampler.probabilities`
(temperature, then top-k, then top-p), the processing every verifier assumes.
"""

from __future__ import annotations

import math

import pytest
import torch

from redwood.bench.stats import CHI2_999, chi2_fit_samples
from redwood.sample.random import RowRandom
from redwood.sample.sampler import probabilities
from redwood.sample.tree_verify import CHILD_RULE, draw_children, verify_tree, verify_tree_paths


def assert_fits(samples: torch.Tensor, probs: torch.Tensor, what: str, min_expected: float = 5.0) -> None:
    """χ² test of integer cell indices `samples` against cell probabilities `probs` (any shape, flattened).

    Cells of probability 0 must never be observed. Cells expecting fewer than `min_expected` draws are
    pooled (with the smallest regular cell if the pool alone is still too small).
    """
    fit = chi2_fit_samples(samples, probs, min_expected)
    assert fit["forbidden"] == 0, f"{what}: drew cells of probability 0: {fit['forbidden_cells']}"
    df, stat = fit["df"], fit["stat"]
    if df == 0:  # a single possible cell: every sample must be in it (checked above)
        return
    assert stat < CHI2_999[df], f"{what}: χ² = {stat:.1f} > {CHI2_999[df]} (df {df})"


def gens(n: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]


def dist(logits, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """probabilities() of logits [..., V] at one temperature / top-p."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    m = flat.shape[0]
    out = probabilities(
        flat, torch.full((m,), float(temperature)), torch.zeros(m, dtype=torch.long), torch.full((m,), float(top_p))
    )
    return out.reshape(logits.shape)


def emitted(tokens: torch.Tensor, accepted: list[list[int]], next_token: torch.Tensor) -> list[list[int]]:
    """Per row, the tokens emitted this step: the accepted path's tokens, then the next token."""
    tok = tokens.tolist()
    nxt = next_token.tolist()
    return [[tok[b][v] for v in path] + [nxt[b]] for b, path in enumerate(accepted)]


def depth1_round(
    verifier: str, p: torch.Tensor, q: torch.Tensor, k: int, rows: int, seed: int, source: str = "generators"
):
    """One step over a root with k children drawn from q by the verifier's rule, for `rows` rows.

    source "generators": the draft side uses one generator for all rows (one call), the verifier one
    generator per row; "device": the engine's counter-based `RowRandom` (one row for the draft side,
    `rows` rows for the verifier). Returns (tokens [rows, k+1], accepted, next_token).
    """
    V = p.numel()
    if source == "generators":
        draft_rand, verify_rand = [torch.Generator().manual_seed(seed)], gens(rows, seed + 1)
    else:
        draft_rand = RowRandom([seed], "cpu")
        verify_rand = RowRandom([(seed + 1) * 1_000_003 + i for i in range(rows)], "cpu")
    children = draw_children(
        q.expand(rows, V), k, CHILD_RULE[verifier], draft_rand, rows=torch.zeros(rows, dtype=torch.long)
    )
    tokens = torch.cat([torch.zeros(rows, 1, dtype=torch.long), children], dim=1)
    target = p.expand(rows, k + 1, V).contiguous()
    draft = q.expand(rows, k + 1, V).contiguous()
    accepted, nxt = verify_tree(verifier, [-1] + [0] * k, tokens, target, draft, verify_rand)
    return tokens, accepted, nxt


# ------------------------------------------------------------------------------------------ first token

STOCHASTIC = ["sequoia", "specinfer", "topk"]


def _case(name: str):
    """(p, q, k) for a named toy case."""
    if name == "peaked":  # target nearly deterministic, draft flatter
        return dist([6.0, 1.0, 0.5, 0.0, -1.0, -2.0]), dist([1.0, 1.5, 0.5, 0.0, 0.0, -0.5]), 2
    if name == "zeros":  # zero-probability tokens in p and (elsewhere) in q
        return (torch.tensor([0.4, 0.0, 0.3, 0.0, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.0, 0.2, 0.0, 0.2]), 2)
    if name == "far":  # draft mass where the target has little
        p = torch.tensor([0.35, 0.3, 0.2, 0.1, 0.02, 0.01, 0.01, 0.01])
        q = torch.tensor([0.01, 0.01, 0.01, 0.01, 0.24, 0.24, 0.24, 0.24])
        return p, q, 3
    if name == "exhausted":  # k = 4 > |supp q| = 2, and p has mass outside q's support
        return (torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1]), torch.tensor([0.0, 0.7, 0.3, 0.0, 0.0, 0.0]), 4)
    if name == "exhausted_one":  # q a point mass, p disjoint from it, k = 3
        return (torch.tensor([0.0, 0.5, 0.25, 0.25, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), 3)
    raise ValueError(name)


@pytest.mark.parametrize("verifier", STOCHASTIC)
@pytest.mark.parametrize("case", ["peaked", "zeros", "far", "exhausted", "exhausted_one"])
@pytest.mark.parametrize("source", ["generators", "device"])
def test_first_token_is_distributed_as_target(verifier, case, source):
    p, q, k = _case(case)
    seed = 17 + ["peaked", "zeros", "far", "exhausted", "exhausted_one"].index(case)
    tokens, accepted, nxt = depth1_round(verifier, p, q, k, rows=8000, seed=seed, source=source)
    first = torch.tensor([e[0] for e in emitted(tokens, accepted, nxt)])
    assert_fits(first, p, f"{verifier}/{case} ({source} random numbers)")


@pytest.mark.parametrize("verifier", STOCHASTIC)
@pytest.mark.parametrize("temperature,top_p", [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (0.5, 0.9), (1.0, 0.9), (1.5, 0.9)])
def test_first_token_under_temperature_and_top_p(verifier, temperature, top_p):
    g = torch.Generator().manual_seed(int(temperature * 10 + top_p * 100))
    V = 8
    target_logits = torch.randn(V, generator=g) * 1.5
    draft_logits = -0.8 * target_logits + torch.randn(V, generator=g)  # anti-correlated: q far from p
    p, q = dist(target_logits, temperature, top_p), dist(draft_logits, temperature, top_p)
    tokens, accepted, nxt = depth1_round(verifier, p, q, 3, rows=8000, seed=int(temperature * 7 + top_p * 3))
    first = torch.tensor([e[0] for e in emitted(tokens, accepted, nxt)])
    assert_fits(first, p, f"{verifier} T={temperature} top_p={top_p}")


# ------------------------------------------------------------------------------------------ deeper trees


def markov_round(verifier: str, P: torch.Tensor, Q: torch.Tensor, widths: list[int], rows: int, seed: int):
    """One step over a full tree (widths per level) for a target and draft that are fixed functions of the
    previous token: p after token x is P[x], q after x is Q[x]. The root token is 0. Returns per-row
    emitted token lists."""
    draft_gen = torch.Generator().manual_seed(seed)
    parents, level_nodes = [-1], [[0]]
    tokens = [torch.zeros(rows, dtype=torch.long)]
    for w in widths:
        prev = level_nodes[-1]
        prev_tok = torch.stack([tokens[v] for v in prev], dim=1)  # [rows, m]
        kids = draw_children(
            Q[prev_tok.flatten()],
            w,
            CHILD_RULE[verifier],
            [draft_gen],
            rows=torch.zeros(prev_tok.numel(), dtype=torch.long),
        ).view(rows, len(prev), w)
        nodes = []
        for i, v in enumerate(prev):
            for j in range(w):
                nodes.append(len(parents))
                parents.append(v)
                tokens.append(kids[:, i, j])
        level_nodes.append(nodes)
    tok = torch.stack(tokens, dim=1)  # [rows, n]
    accepted, nxt = verify_tree(verifier, parents, tok, P[tok], Q[tok], gens(rows, seed + 1))
    return emitted(tok, accepted, nxt), accepted


@pytest.mark.parametrize("verifier", STOCHASTIC)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.5, 0.9)])
def test_first_two_tokens_joint_on_two_level_tree(verifier, temperature, top_p):
    """Joint of the first two emitted tokens = p_root(x)·P[x](y). When a step emits only one token, the
    second is what the next step would emit first, i.e. a draw from P[x] (checked by the tests above)."""
    V = 5
    g = torch.Generator().manual_seed(11 if temperature == 1.0 else 12)
    P = dist(torch.randn(V, V, generator=g) * 1.5, temperature, top_p)
    Q = dist(torch.randn(V, V, generator=g) * 1.5, temperature, top_p)
    rows = 10000
    out, accepted = markov_round(verifier, P, Q, [2, 2], rows, seed=3 + int(temperature * 10))
    first = torch.tensor([e[0] for e in out])
    fill = torch.multinomial(P[first], 1, generator=torch.Generator().manual_seed(99))[:, 0]
    pairs = [e[0] * V + (e[1] if len(e) > 1 else int(fill[b])) for b, e in enumerate(out)]
    assert max(len(a) for a in accepted) == 2  # the walk does reach the second level
    joint = P[0][:, None] * P  # [x, y]
    assert_fits(torch.tensor(pairs), joint, f"{verifier} joint T={temperature} top_p={top_p}")


@pytest.mark.parametrize("verifier", STOCHASTIC)
def test_first_three_tokens_joint_including_leaf_bonus(verifier):
    """A full emission of a 2-level tree is 3 tokens (two accepted nodes + the bonus at the leaf)."""
    V = 4
    g = torch.Generator().manual_seed(5)
    P = dist(torch.randn(V, V, generator=g) * 1.2)
    Q = (P + dist(torch.randn(V, V, generator=g) * 2.0)) / 2  # close-ish to P so full paths are common
    rows = 12000
    out, _ = markov_round(verifier, P, Q, [2, 2], rows, seed=41)
    fill = torch.Generator().manual_seed(7)
    seqs = torch.tensor([e + [-1] * (3 - len(e)) for e in out])  # -1: emitted by the following steps
    for j in (1, 2):
        short = seqs[:, j] < 0
        seqs[short, j] = torch.multinomial(P[seqs[short, j - 1]], 1, generator=fill)[:, 0]
    cells = (seqs[:, 0] * V + seqs[:, 1]) * V + seqs[:, 2]
    joint = P[0][:, None, None] * P[:, :, None] * P[None]  # P0(x) P[x](y) P[y](z)
    assert_fits(cells, joint, f"{verifier} triple")


# ------------------------------------------------------------------------------------------ greedy


def test_greedy_follows_target_argmax_walk():
    g = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 6]  # ragged: widths 3 / 2,1,1 / 2,0,1,0
    n, V, B = len(parents), 4, 300
    tokens = torch.randint(0, V, (B, n), generator=g)
    target = torch.rand(B, n, V, generator=g).softmax(-1)
    accepted, nxt = verify_tree("greedy", parents, tokens, target, None, gens(B, 1))
    kids = {v: [i for i in range(n) if parents[i] == v] for v in range(n)}
    depths = set()
    for b in range(B):
        cur, path = 0, []
        while True:
            best = int(target[b, cur].argmax())
            match = [c for c in kids[cur] if int(tokens[b, c]) == best]
            if not match:
                break
            cur = match[0]
            path.append(cur)
        assert accepted[b] == path
        assert int(nxt[b]) == int(target[b, cur].argmax())
        depths.add(len(path))
    assert depths == {0, 1, 2, 3}


def test_greedy_with_temperature_zero_one_hot_and_top_k_children():
    V = 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(V, V, generator=g)
    P = dist(logits, temperature=0.0)  # one-hot rows
    Q = dist(logits + torch.randn(V, V, generator=g))  # a draft that often has the argmax in its top 3
    out, accepted = markov_round("greedy", P, Q, [3, 2, 2], rows=4, seed=1)
    assert len(accepted[0]) >= 1
    for e in out:  # exactly what greedy autoregressive decoding from token 0 produces
        want, t = [], 0
        for _ in e:
            t = int(P[t].argmax())
            want.append(t)
        assert e == want


# ------------------------------------------------------------------------------------------ properties


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer"])
@pytest.mark.parametrize("case", ["zeros", "far", "peaked"])
def test_one_candidate_acceptance_is_one_minus_tv(verifier, case):
    """Optimal transport: with one candidate the acceptance probability is Σ min(p, q) = 1 − TV(p, q)."""
    p, q, _ = _case(case)
    rows = 10000
    _, accepted, _ = depth1_round(verifier, p, q, 1, rows, seed=5)
    rate = 1.0 - 0.5 * float((p - q).abs().sum())
    hits = sum(1 for a in accepted if a)
    sd = math.sqrt(rows * rate * (1 - rate))
    assert abs(hits - rows * rate) < 4.5 * sd + 1e-9, (hits / rows, rate)


def test_topk_one_candidate_acceptance_is_p_of_draft_top1():
    p, q, _ = _case("far")
    rows = 10000
    _, accepted, _ = depth1_round("topk", p, q, 1, rows, seed=6)
    rate = float(p[int(q.argmax())])
    hits = sum(1 for a in accepted if a)
    assert abs(hits - rows * rate) < 4.5 * math.sqrt(rows * rate * (1 - rate))


@pytest.mark.parametrize(
    "p,q,k,always",
    [
        ([0.5, 0.3, 0.2, 0, 0, 0], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3], 4, False),  # covers in some rows
        ([0.5, 0.3, 0.2, 0, 0, 0], [0.4, 0.05, 0.05, 0.5, 0, 0], 4, True),  # supp q ⊇ supp p, k = |supp q|
        ([0.0, 0.6, 0.4, 0, 0], [1.0, 0, 0, 0, 0], 3, False),  # exhausted support, uniform fill
        ([0.2, 0.2, 0.2, 0.2, 0.2], [0.96, 0.01, 0.01, 0.01, 0.01], 5, True),  # k = V
    ],
)
def test_sequoia_cover_accepts_whenever_children_cover_target_support(p, q, k, always):
    p, q = torch.tensor(p), torch.tensor(q)
    rows = 4000
    tokens, accepted, _ = depth1_round("sequoia", p, q, k, rows, seed=8)
    support = set((p > 0).nonzero().flatten().tolist())
    covering = 0
    for b in range(rows):
        if support <= set(tokens[b, 1:].tolist()):
            covering += 1
            assert accepted[b], f"row {b}: children {tokens[b, 1:].tolist()} cover supp p but none accepted"
    assert covering == rows if always else covering > 100


def test_sequoia_accepts_first_child_when_draft_equals_target():
    p = dist([1.0, 0.5, -0.3, 2.0, 0.0])
    tokens, accepted, _ = depth1_round("sequoia", p, p, 3, 500, seed=2)
    assert all(a == [1] for a in accepted)


def test_zero_mass_residual_falls_back_to_target():
    """p ≤ q everywhere (an unnormalized p): a rejection leaves no residual mass; the guard keeps p."""
    p = torch.tensor([0.25, 0.25, 0.0, 0.0])  # sums to 0.5 (as if round-off), so p < q where q > 0
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    for verifier in ("sequoia", "specinfer"):
        tokens, accepted, nxt = depth1_round(verifier, p, q, 2, 2000, seed=4)
        first = torch.tensor([e[0] for e in emitted(tokens, accepted, nxt)])
        assert set(first.tolist()) <= {0, 1}
        assert any(not a for a in accepted)  # the fallback was exercised


# ------------------------------------------------------------------------------------------ randomness


def _random_batch(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    parents = [-1, 0, 0, 1, 1, 2]
    V = 5
    tokens = torch.randint(0, V, (B, len(parents)), generator=g)
    target = torch.rand(B, len(parents), V, generator=g).softmax(-1)
    draft = torch.rand(B, len(parents), V, generator=g).softmax(-1)
    return parents, tokens, target, draft


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer", "topk"])
def test_rows_are_independent_of_the_batch_and_draws_are_fresh(verifier):
    parents, tokens, target, draft = _random_batch(64, 1)
    a_batch, n_batch = verify_tree(verifier, parents, tokens, target, draft, gens(64, 9))
    for b in (0, 17, 63):  # the same row alone, with a freshly seeded copy of its generator
        g = torch.Generator().manual_seed(9 * 1_000_003 + b)
        a, nt = verify_tree(verifier, parents, tokens[b : b + 1], target[b : b + 1], draft[b : b + 1], [g])
        assert a[0] == a_batch[b] and int(nt[0]) == int(n_batch[b])
    # Reusing the generators for a second step gives fresh draws, not a replay.
    gs = gens(64, 9)
    first = verify_tree(verifier, parents, tokens, target, draft, gs)
    second = verify_tree(verifier, parents, tokens, target, draft, gs)
    assert first[0] == a_batch and torch.equal(first[1], n_batch)
    assert first[0] != second[0] or not torch.equal(first[1], second[1])


def test_invalid_trees_and_arguments_are_rejected():
    tokens, probs = torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4, 3), 1 / 3)
    g = [torch.Generator()]
    with pytest.raises(ValueError):
        verify_tree("sequoia", [-1, 0, 1, 0], tokens, probs, probs, g)  # children of 0 not contiguous
    with pytest.raises(ValueError):
        verify_tree("sequoia", [0, 0, 1, 2], tokens, probs, probs, g)  # no root
    with pytest.raises(ValueError):
        verify_tree("sequoia", [-1, 0, 3, 1], tokens, probs, probs, g)  # parent after child
    with pytest.raises(ValueError):
        verify_tree("beam", [-1, 0, 0, 0], tokens, probs, probs, g)
    with pytest.raises(ValueError):
        verify_tree("specinfer", [-1, 0, 0, 0], tokens, probs, None, g)
    with pytest.raises(ValueError):
        draw_children(probs[0], 4, "swor", g * 4)  # k > V
    with pytest.raises(ValueError):
        draw_children(probs[0], 2, "nucleus", g * 4)


# ------------------------------------------------------------------------------------------ drawing rules


def test_swor_children_distinct_and_first_two_are_sequential_draws():
    q = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    N, V = 12000, 6
    kids = draw_children(q.expand(N, V), 3, "swor", gens(N, 21))  # one generator per node
    assert all(len(set(r)) == 3 for r in kids.tolist())
    assert not (kids == 5).any()  # q = 0 never drawn while q has support
    # P(a, b) = q(a) q(b) / (1 − q(a)) for a ≠ b.
    joint = q[:, None] * q[None, :] / (1 - q[:, None])
    joint.fill_diagonal_(0)
    assert_fits(kids[:, 0] * V + kids[:, 1], joint, "swor first two draws")
    assert_fits(kids[:, 0], q, "swor first draw")


def test_swor_exhausted_support_fills_uniformly_from_untried_tokens():
    q = torch.tensor([0.0, 0.8, 0.0, 0.2, 0.0, 0.0])
    N, V = 6000, 6
    kids = draw_children(
        q.expand(N, V), 5, "swor", [torch.Generator().manual_seed(3)], rows=torch.zeros(N, dtype=torch.long)
    )
    assert all(len(set(r)) == 5 for r in kids.tolist())
    assert_fits(kids[:, 0], q, "swor exhausted: first draw")
    assert all(set(r[:2]) == {1, 3} for r in kids.tolist())  # the support comes first
    rest = torch.tensor([0.25 if t in (0, 2, 4, 5) else 0.0 for t in range(V)])
    assert_fits(kids[:, 2], rest, "swor exhausted: third draw uniform over the untried tokens")
    pairs = rest[:, None] * rest[None, :]
    pairs.fill_diagonal_(0)
    assert_fits(kids[:, 2] * V + kids[:, 3], pairs, "swor exhausted: (third, fourth) uniform ordered pairs")


def test_replacement_children_are_iid():
    q = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    N, V = 10000, 5
    kids = draw_children(q.expand(N, V), 2, "replacement", gens(N, 22))
    assert not (kids == 1).any()
    assert_fits(kids[:, 0] * V + kids[:, 1], q[:, None] * q[None, :], "replacement pair")


def test_topk_children_are_draft_top_k_with_low_index_ties():
    q = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1], [0.0, 0.0, 0.0, 1.0, 0.0]])
    kids = draw_children(q, 3, "topk", [])
    assert kids.tolist() == [[1, 2, 3], [3, 0, 1]]


def test_coupled_children_draw_the_first_by_inverse_cdf_and_the_rest_top_k():
    """The first child is inverse_cdf(q, u) for the given uniform; the others are q's most likely
    tokens besides it (distinct, ties to the lower id); a one-hot (greedy) q gives its argmax first."""
    q = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]] * 3 + [[0.0, 0.0, 0.0, 1.0, 0.0]])
    u = torch.tensor([0.05, 0.45, 0.95, 0.5], dtype=torch.float64)
    assert draw_children(q, 1, "coupled", None, uniforms=u)[:, 0].tolist() == [0, 2, 4, 3]
    assert draw_children(q, 3, "coupled", None, uniforms=u).tolist() == [[0, 1, 2], [2, 1, 3], [4, 1, 2], [3, 0, 1]]
    # without uniforms: fresh ones from the generators — the first child a plain draw from q
    N = 8000
    kids = draw_children(q[:1].expand(N, -1), 2, "coupled", gens(N, 23))
    assert_fits(kids[:, 0], q[0], "coupled first child without given uniforms")
    assert (kids[:, 0] != kids[:, 1]).all()


def test_match_walk_follows_the_depths_uniforms():
    """Node uniforms are per depth: at each node the walk's token is inverse_cdf(p, u of its depth).
    Root p puts u = 0.3 on token 1 (child 2), child 2's p puts u = 0.9 on token 3 (no child): emitted
    [1, 3]; with u = 0.1 at the root it takes token 0 (child 1, a leaf) and emits the bonus from node 1."""
    parents = [-1, 0, 0, 2]
    p = torch.tensor([[0.25, 0.5, 0.25, 0.0], [0.0, 0.0, 1.0, 0.0], [0.1, 0.1, 0.6, 0.2], [1.0, 0.0, 0.0, 0.0]])[None]
    tokens = torch.tensor([[0, 0, 1, 2]])
    u = torch.tensor([[0.3, 0.9, 0.9, 0.5]], dtype=torch.float64)  # depth 0, 1, 1, 2
    path, nxt = verify_tree_paths("match", parents, tokens, p, None, None, u)
    assert path.tolist() == [[2, -1]] and nxt.tolist() == [3]
    u = torch.tensor([[0.1, 0.5, 0.5, 0.5]], dtype=torch.float64)
    path, nxt = verify_tree_paths("match", parents, tokens, p, None, None, u)
    assert path.tolist() == [[1, -1]] and nxt.tolist() == [2]
    # no node uniforms: one fresh draw per depth, shared by the depth's nodes (and the counter advances)
    rand = RowRandom([5], "cpu")
    verify_tree_paths("match", parents, tokens, p, None, rand)
    assert rand.counter.tolist() == [1]
    with pytest.raises(ValueError, match="node_uniforms"):
        verify_tree_paths("match", parents, tokens, p, None, None, u[:, :3])


def test_row_index_maps_nodes_to_generators():
    q = torch.full((6, 8), 1 / 8)
    rows = torch.tensor([0, 1, 0, 1, 2, 0])
    a = draw_children(q, 3, "swor", gens(3, 5), rows=rows)
    b = draw_children(q, 3, "swor", gens(3, 5), rows=rows)
    assert torch.equal(a, b)  # reproducible from the seeds
    assert not torch.equal(a[0], a[2]) or not torch.equal(a[0], a[5])  # nodes sharing a generator differ
    # Row 2's node depends only on generator 2.
    alone = draw_children(q[4:5], 3, "swor", gens(3, 5), rows=torch.tensor([2]))
    assert torch.equal(alone[0], a[4])
