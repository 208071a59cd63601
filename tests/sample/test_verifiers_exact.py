"""The exact output distribution of every verifier, with no sampling noise.

Why this is exact. Each random number a verifier consumes is a float64 uniform u = k · 2^-53 (k an
integer in [0, 2^53)), as `RowRandom` draws them, and each one decides exactly one thing: an acceptance
test (the child is accepted iff k is below some threshold) or a draw by inverse CDF (the token is
non-decreasing in k). So for fixed draft tokens every outcome of a step is a box of the lattice, and its
probability is a product of interval lengths. The tests find each interval's end *from the code itself*:
they drive the verifier with scripted uniforms (`Scripted`) that force the walk into one context (earlier
children accepted with k = 0, rejected with k = 2^53 − 1) and bisect over the free k (54 batched calls of
the verifier per round, all contexts at once). Weighting by the exact probability of drawing the draft
tokens by the verifier's child rule gives the exact distribution of what one step emits (the accepted
tokens and the correction / bonus token). Extended by target draws to a fixed length, it must equal the
target's own joint distribution of that many tokens — within float rounding (the verifiers' probability
math is float32), not within a χ² tolerance.

Target and draft distributions are position-dependent (a fresh random logit row for every prefix, so a
wrong prefix or position shows) and go through `probabilities` (temperature, top-k, top-p) as in the
engine.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from redwood.bench.stats import first_true
from redwood.bench.stats import grid_uniform as lattice
from redwood.sample.chain_verify import verify_greedy, verify_match, verify_sampling
from redwood.sample.random import RowRandom
from redwood.sample.sampler import probabilities
from redwood.sample.tree_verify import CHILD_RULE, draw_children, verify_tree_paths

LATTICE = 2**53  # float64 uniforms are k / 2^53
TOP = LATTICE - 1  # the largest uniform: rejects whatever can be rejected
ATOL = 2e-6  # float32 probability math over a handful of operations


class Scripted(RowRandom):
    """A random source whose one draw returns preset uniforms u [B, *shape] (float64)."""

    def __init__(self, u: torch.Tensor):
        self.u, self.calls = u, 0

    def uniform(self, rows, shape, dtype=torch.float32):
        assert dtype == torch.float64, "verifier uniforms must be float64 (53 bits)"
        assert self.calls == 0, "one draw per verification"
        self.calls += 1
        B = self.u.shape[0]
        assert rows is None or torch.equal(rows.cpu(), torch.arange(B))
        return self.u.reshape(B, *shape)


# ------------------------------------------------------------------------------------------ distributions


def prefixes(V: int, depth: int) -> list[tuple[int, ...]]:
    return [t for d in range(depth + 1) for t in itertools.product(range(V), repeat=d)]


def tables(V: int, depth: int, temperature: float, top_k: int, top_p: float, draft: str, seed: int):
    """p[prefix], q[prefix]: target / draft distributions [V] (float32) after every prefix of ≤ depth
    tokens. draft: 'near' (the target's logits plus noise), 'far' (independent), 'same', 'onehot' (one token
    per prefix with probability 1: a draftless drafter's deterministic proposal)."""
    g = torch.Generator().manual_seed(seed)
    keys = prefixes(V, depth)
    lp = torch.randn(len(keys), V, generator=g) * 1.5
    lq = {
        "near": lp + 0.7 * torch.randn(len(keys), V, generator=g),
        "far": torch.randn(len(keys), V, generator=g) * 1.5,
        "same": lp,
        "onehot": torch.randn(len(keys), V, generator=g),
    }[draft]
    n = len(keys)
    args = (torch.full((n,), float(temperature)), torch.full((n,), top_k), torch.full((n,), float(top_p)))
    P, Q = probabilities(lp, *args), probabilities(lq, *args)
    if draft == "onehot":  # a deterministic proposal per prefix (a draftless drafter's): one-hot q
        Q = torch.nn.functional.one_hot(lq.argmax(-1), V).float()
    return dict(zip(keys, P)), dict(zip(keys, Q))


def target_joint(p: dict, length: int) -> dict[tuple[int, ...], float]:
    """The target's exact joint probability of every sequence of `length` tokens."""
    V = len(p[()])
    out = {}
    for y in itertools.product(range(V), repeat=length):
        out[y] = math.prod(float(p[y[:j]][y[j]]) for j in range(length))
    return out


def extended(emitted: dict[tuple[int, ...], float], p: dict, length: int) -> dict[tuple[int, ...], float]:
    """A step's emission probabilities (token tuples of varying length), each continued by target draws to
    `length` tokens: the joint distribution of the first `length` tokens generated."""
    V = len(p[()])
    out = dict.fromkeys(itertools.product(range(V), repeat=length), 0.0)
    for y in out:
        out[y] = sum(
            emitted.get(y[:m], 0.0) * math.prod(float(p[y[:j]][y[j]]) for j in range(m, length))
            for m in range(1, length + 1)
        )
    return out


def assert_joint_matches(emitted: dict, p: dict, length: int, label: str) -> None:
    total = sum(emitted.values())
    assert total == pytest.approx(1.0, abs=ATOL), f"{label}: emission probabilities sum to {total}"
    got, want = extended(emitted, p, length), target_joint(p, length)
    worst = max(want, key=lambda y: abs(got[y] - want[y]))
    assert abs(got[worst] - want[worst]) <= ATOL, (
        f"{label}: P{worst} = {got[worst]:.9f} emitted vs {want[worst]:.9f} target"
    )


# ------------------------------------------------------------------------------------------ chains


def chain_emission(p: dict, q: dict, gamma: int) -> dict[tuple[int, ...], float]:
    """Exact emission probabilities of `verify_sampling` for γ drafts drawn from q."""
    V = len(p[()])
    drafts, weights = [], []
    for d in itertools.product(range(V), repeat=gamma):
        w = math.prod(float(q[d[:i]][d[i]]) for i in range(gamma))
        if w > 0:  # (the draft never draws a token q gives no mass)
            drafts.append(d)
            weights.append(w)
    M = len(drafts)
    D = torch.tensor(drafts).view(M, gamma)
    P = torch.stack([torch.stack([p[d[:i]] for i in range(gamma + 1)]) for d in drafts])  # [M, γ+1, V]
    Q = torch.stack([torch.stack([q[d[:i]] for i in range(gamma)]) for d in drafts])  # [M, γ, V]

    def run(rows, u):  # rows [R] → accepted [R], next token [R]
        return verify_sampling(P[rows], Q[rows], D[rows], Scripted(u))

    # Round 1: the acceptance measure of draft i given drafts < i accepted (context: k = 0 before it).
    rows = torch.arange(M).repeat_interleave(gamma)
    pos = torch.arange(gamma).repeat(M)
    base = torch.where(torch.arange(gamma + 1)[None] < pos[:, None], 0.0, 0.5).double()

    def rejected_at(k):
        u = base.clone()
        u[torch.arange(len(rows)), pos] = lattice(k)
        return run(rows, u)[0] <= pos

    accept = (first_true(rejected_at, len(rows)).double() / LATTICE).view(M, gamma)

    # Round 2: the correction / bonus token's CDF after a accepted drafts (draft a rejected with k = TOP).
    ctx = [(m, a, x) for m in range(M) for a in range(gamma + 1) for x in range(V)]
    cm, ca, cx = (torch.tensor(c) for c in zip(*ctx))
    j = torch.arange(gamma + 1)[None]
    base2 = torch.where(j < ca[:, None], 0.0, torch.where(j == ca[:, None], lattice(torch.tensor(TOP)), 0.5))

    def beyond(k):
        u = base2.clone()
        u[:, gamma] = lattice(k)
        return run(cm, u)[1] > cx

    cdf = (first_true(beyond, len(ctx)).double() / LATTICE).view(M, gamma + 1, V)
    assert torch.all(cdf[..., -1] == 1.0)
    draw = torch.diff(cdf, dim=-1, prepend=torch.zeros(M, gamma + 1, 1, dtype=torch.float64))

    emitted: dict[tuple[int, ...], float] = {}
    for m, d in enumerate(drafts):
        reach = weights[m]
        for a in range(gamma + 1):
            stop = reach * (1.0 - float(accept[m, a])) if a < gamma else reach
            for x in range(V):
                key = d[:a] + (x,)
                emitted[key] = emitted.get(key, 0.0) + stop * float(draw[m, a, x])
            if a < gamma:
                reach *= float(accept[m, a])
    return emitted


SETTINGS = [(t, k, tp) for t in (0.5, 1.0, 1.5) for (k, tp) in ((0, 1.0), (3, 1.0), (0, 0.8), (4, 0.9))]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize(
    "draft,gamma", [("near", 1), ("near", 3), ("far", 2), ("same", 2), ("onehot", 1), ("onehot", 3)]
)
def test_chain_rejection_sampling_is_exact(temperature, top_k, top_p, draft, gamma):
    V = 5
    seed = 100 + SETTINGS.index((temperature, top_k, top_p)) * 7 + gamma
    p, q = tables(V, gamma, temperature, top_k, top_p, draft, seed)
    emitted = chain_emission(p, q, gamma)
    assert_joint_matches(emitted, p, gamma + 1, f"chain γ={gamma} {draft} T={temperature} k={top_k} p={top_p}")


def test_chain_exactness_check_catches_a_biased_verifier(monkeypatch):
    """The same computation flags a verifier whose acceptance is off by 1 % (the check can fail)."""
    import redwood.sample.chain_verify as verifiers

    p, q = tables(5, 2, 1.0, 0, 1.0, "far", 7)
    honest = verifiers.per_row_uniforms

    def biased(rand, rows, shape, dtype, device):
        return (honest(rand, rows, shape, dtype, device) * 1.01).clamp(max=1 - 2**-53)

    monkeypatch.setattr(verifiers, "per_row_uniforms", biased)
    with pytest.raises(AssertionError, match="emitted vs"):
        assert_joint_matches(chain_emission(p, q, 2), p, 3, "biased")


def test_chain_greedy_emits_the_target_argmax_path():
    V, gamma = 5, 3
    p, _ = tables(V, gamma, 0.0, 0, 1.0, "far", 3)  # temperature 0: one-hot rows
    greedy_path = ()
    for _ in range(gamma + 1):
        greedy_path += (int(p[greedy_path].argmax()),)
    for d in itertools.product(range(V), repeat=gamma):
        P = torch.stack([p[d[:i]] for i in range(gamma + 1)])[None]
        a, x = verify_greedy(P, torch.tensor([d]))
        emitted = d[: int(a)] + (int(x),)
        assert emitted == greedy_path[: len(emitted)], (d, emitted, greedy_path)


# ------------------------------------------------------------------------------------------ trees


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for v in range(1, len(parents)):
        kids[parents[v]].append(v)
    return kids


def child_draws(qv: torch.Tensor, k: int, rule: str):
    """Every ordered k-tuple of children the rule can draw from q [V], with its exact probability."""
    V = qv.numel()
    q = [float(x) for x in qv]
    if rule == "replacement":
        for t in itertools.product(range(V), repeat=k):
            w = math.prod(q[x] for x in t)
            if w > 0:
                yield t, w
        return
    # swor: sequential draws without replacement; once q's support is used up, the rest are distinct
    # tokens uniformly from those not drawn yet (draw_children's exhausted-support rule)
    for t in itertools.permutations(range(V), k):
        w = 1.0
        for j, x in enumerate(t):
            left = sum(q[y] for y in range(V) if y not in t[:j])
            w *= q[x] / left if left > 0 else 1.0 / (V - j)
            if w == 0:
                break
        if w > 0:
            yield t, w


def tree_assignments(parents: list[int], q: dict, rule: str):
    """Every assignment of tokens to the tree's nodes (node 0, the root, gets 0) that the draft side can
    produce, with its probability: each node's children drawn by `rule` from q after the node's prefix."""
    kids = children_of(parents)
    n = len(parents)

    def expand(v: int, tokens: list[int], w: float):  # nodes < v have their children assigned
        if v == n:
            yield list(tokens), w
            return
        if not kids[v]:
            yield from expand(v + 1, tokens, w)
            return
        pre = tuple(tokens[u] for u in path_to(parents, v))  # (ancestors come first: assigned already)
        for t, wt in child_draws(q[pre], len(kids[v]), rule):
            for c, x in zip(kids[v], t):
                tokens[c] = x
            yield from expand(v + 1, tokens, w * wt)

    yield from expand(0, [0] * n, 1.0)


def path_to(parents: list[int], v: int) -> list[int]:
    nodes = []
    while v > 0:
        nodes.append(v)
        v = parents[v]
    return list(reversed(nodes))


def tree_inputs(parents, assignments, p, q):
    """tokens [M, n], target_probs / draft_probs [M, n, V] for each assignment (q zero at leaves)."""
    kids = children_of(parents)
    toks = torch.tensor([a for a, _ in assignments])
    P, Q = [], []
    for a, _ in assignments:
        pre = [tuple(a[u] for u in path_to(parents, v)) for v in range(len(parents))]
        P.append(torch.stack([p[s] for s in pre]))
        Q.append(torch.stack([q[s] if kids[v] else torch.zeros_like(q[s]) for v, s in enumerate(pre)]))
    return toks, torch.stack(P), torch.stack(Q)


def forcing(parents, v: int, n: int, rows: int) -> torch.Tensor:
    """Uniforms u [rows, 2, n] that walk straight to node v: each path node accepted (k = 0), its
    earlier siblings rejected (k = TOP); everything else 0.5."""
    kids = children_of(parents)
    u = torch.full((rows, 2, n), 0.5, dtype=torch.float64)
    for c in path_to(parents, v):
        for s in kids[parents[c]]:
            if s == c:
                break
            u[:, 0, s] = lattice(torch.tensor(TOP))
        u[:, 0, c] = 0.0
    return u


def tree_emission_stochastic(verifier: str, parents: list[int], p: dict, q: dict) -> dict:
    """Exact emission probabilities of the sequoia / specinfer walks (children drawn by their rule)."""
    assignments = list(tree_assignments(parents, q, CHILD_RULE[verifier]))
    toks, P, Q = tree_inputs(parents, assignments, p, q)
    M, n, V = P.shape
    kids = children_of(parents)

    def run(rows, u):  # → path [R, depth] (−1 padded), next token [R]
        return verify_tree_paths(verifier, parents, toks[rows], P[rows], Q[rows], Scripted(u))

    # Round 1: every child's acceptance measure in its one context (its parent reached, its earlier
    # siblings rejected).
    ctx = [(m, c) for m in range(M) for c in range(1, n)]
    cm, cc = (torch.tensor(x) for x in zip(*ctx))
    base = torch.cat([forcing(parents, parents[c], n, 1) for c in range(1, n)])  # [n − 1, 2, n]
    for c in range(1, n):  # earlier siblings of c rejected
        for s in kids[parents[c]]:
            if s == c:
                break
            base[c - 1, 0, s] = lattice(torch.tensor(TOP))
    base = base.repeat(M, 1, 1)
    depth = torch.tensor([len(path_to(parents, c)) for c in range(n)])

    def rejected(k):
        u = base.clone()
        u[torch.arange(len(ctx)), 0, cc] = lattice(k)
        path, _ = run(cm, u)
        return path[torch.arange(len(ctx)), depth[cc] - 1] != cc

    accept = torch.ones(M, n, dtype=torch.float64)
    accept[:, 1:] = (first_true(rejected, len(ctx)).double() / LATTICE).view(M, n - 1)

    # Round 2: the correction / bonus token's CDF at each stopping node (its children all rejected).
    ctx2 = [(m, v, x) for m in range(M) for v in range(n) for x in range(V)]
    dm, dv, dx = (torch.tensor(x) for x in zip(*ctx2))
    stops = torch.cat([forcing(parents, v, n, 1) for v in range(n)])
    for v in range(n):
        for c in kids[v]:
            stops[v, 0, c] = lattice(torch.tensor(TOP))
    base2 = stops.repeat_interleave(V, dim=0).repeat(M, 1, 1)

    def beyond(k):
        u = base2.clone()
        u[torch.arange(len(ctx2)), 1, dv] = lattice(k)
        return run(dm, u)[1] > dx

    cdf = (first_true(beyond, len(ctx2)).double() / LATTICE).view(M, n, V)
    assert torch.all(cdf[..., -1] == 1.0)
    draw = torch.diff(cdf, dim=-1, prepend=torch.zeros(M, n, 1, dtype=torch.float64))

    emitted: dict[tuple[int, ...], float] = {}
    for m, (tokens, w) in enumerate(assignments):
        for v in range(n):
            reach = w
            for c in path_to(parents, v):  # accept c after rejecting its earlier siblings
                for s in kids[parents[c]]:
                    if s == c:
                        break
                    reach *= 1.0 - float(accept[m, s])
                reach *= float(accept[m, c])
            for c in kids[v]:
                reach *= 1.0 - float(accept[m, c])
            head = tuple(tokens[u] for u in path_to(parents, v))
            for x in range(V):
                emitted[head + (x,)] = emitted.get(head + (x,), 0.0) + reach * float(draw[m, v, x])
    return emitted


def tree_emission_topk(parents: list[int], p: dict, q: dict | None, tokens: list[int] | None = None) -> dict:
    """Exact emission probabilities of the topk walk: children are q's top tokens, or the given node
    `tokens` (deterministic either way); at each node y ~ p is drawn, the child equal to y is taken, else y
    is emitted."""
    kids = children_of(parents)
    n = len(parents)
    if tokens is None:
        tokens = [0] * n
        for v in range(n):  # breadth-first: a node's prefix is known before its children are drawn
            if kids[v]:
                pre = tuple(tokens[u] for u in path_to(parents, v))
                top = draw_children(q[pre][None], len(kids[v]), "topk", None)[0].tolist()
                for c, x in zip(kids[v], top):
                    tokens[c] = x
    P = torch.stack([p[tuple(tokens[u] for u in path_to(parents, v))] for v in range(n)])[None]
    toks = torch.tensor([tokens])
    V = P.shape[-1]

    emitted: dict[tuple[int, ...], float] = {}
    frontier = [(0, torch.full((2, n), 0.5, dtype=torch.float64), 1.0)]  # (node, uniforms reaching it, prob)
    while frontier:
        v, u_v, w = frontier.pop()
        base = u_v[None].repeat(V, 1, 1)
        xs = torch.arange(V)

        level = len(path_to(parents, v))  # v's depth: the path's entry after v is at this index
        node_tokens = toks.expand(V, -1)

        def beyond(k):  # the token drawn at v: the child taken there, or the token emitted there
            u = base.clone()
            u[:, 1, v] = lattice(k)
            path, nxt = verify_tree_paths("topk", parents, node_tokens, P.expand(V, -1, -1), None, Scripted(u))
            if level < path.shape[1]:
                moved = path[:, level] >= 0
                nxt = torch.where(moved, node_tokens.gather(1, path[:, level : level + 1].clamp(min=0))[:, 0], nxt)
            return nxt > xs

        def path_len(u):
            path, _ = verify_tree_paths("topk", parents, toks, P, None, Scripted(u[None]))
            return int((path >= 0).sum())

        F = first_true(beyond, V)
        lo = torch.cat([torch.zeros(1, dtype=torch.long), F[:-1]])
        for x in range(V):
            mass = float(F[x] - lo[x]) / LATTICE
            if mass == 0:
                continue
            u_x = u_v.clone()
            u_x[1, v] = lattice(lo[x])  # a uniform that draws x at v
            child = next((c for c in kids[v] if tokens[c] == x), None)
            if child is None:
                head = tuple(tokens[u] for u in path_to(parents, v))
                assert path_len(u_x) == len(head)
                emitted[head + (x,)] = emitted.get(head + (x,), 0.0) + w * mass
            else:
                frontier.append((child, u_x, w * mass))
    return emitted


TREES = {
    "fork-2x2": [-1, 0, 0, 1, 1],  # root with two children, the first with two more
    "wide-3+chain": [-1, 0, 0, 0, 1, 4],  # three children at the root, a chain of two below the first
    "chain-3": [-1, 0, 1, 2],
}


@pytest.mark.parametrize("verifier", ["sequoia", "specinfer"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 0.8), (1.5, 2, 1.0), (1.0, 3, 0.9)])
def test_tree_walks_are_exact(verifier, tree, temperature, top_k, top_p):
    """With top-k 2 the root's three children exceed q's support: sequoia's exhausted-support rule runs."""
    V = 4
    parents = TREES[tree]
    depth = max(len(path_to(parents, v)) for v in range(len(parents)))
    p, q = tables(V, depth, temperature, top_k, top_p, "near" if tree != "chain-3" else "far", seed=11 + depth)
    emitted = tree_emission_stochastic(verifier, parents, p, q)
    assert_joint_matches(emitted, p, depth + 1, f"{verifier} {tree} T={temperature} k={top_k} p={top_p}")


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 3, 0.9), (1.5, 0, 0.8)])
def test_topk_walk_is_exact(tree, temperature, top_k, top_p):
    V = 5
    parents = TREES[tree]
    depth = max(len(path_to(parents, v)) for v in range(len(parents)))
    p, q = tables(V, depth, temperature, top_k, top_p, "near", seed=21 + depth)
    emitted = tree_emission_topk(parents, p, q)
    assert_joint_matches(emitted, p, depth + 1, f"topk {tree} T={temperature} k={top_k} p={top_p}")


@pytest.mark.parametrize("branching", [(2, 2), (3, 2, 1, 1)])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 3, 0.9), (1.5, 0, 0.8)])
def test_topk_walk_is_exact_over_suffix_children(branching, temperature, top_k, top_p):
    """The suffix drafter's tree (`speculation.suffix.fill_tree` after a history): children ranked by their
    n-gram counts, padded with the parent's token where the history has too few — so some siblings repeat
    and some nodes are padding. No q exists for such children; topk is exact over them all the same."""
    from redwood.speculation.suffix import fill_tree
    from redwood.speculation.suffix_index import SuffixIndex, ranked_children
    from redwood.speculation.trees import Tree

    V = 5
    tree = Tree.from_branching(branching)
    parents = list(tree.parents)
    index = SuffixIndex(1, 2)
    index.extend([0, 1, 2, 0, 1, 3, 4, 0, 1])
    lookup = lambda tail, k: ranked_children((index,), tail, k, 1, 2)  # noqa: E731
    tokens, found = fill_tree(tree, index.tokens, lookup, 2)
    assert not all(found), "the case must include padded nodes"
    depth = tree.max_depth - 1
    p, _ = tables(V, depth, temperature, top_k, top_p, "far", seed=31 + len(parents))
    emitted = tree_emission_topk(parents, p, None, tokens)
    assert_joint_matches(emitted, p, depth + 1, f"topk suffix {branching} T={temperature} k={top_k} p={top_p}")


def test_tree_greedy_walk_emits_the_target_argmax_path():
    V = 4
    parents = TREES["fork-2x2"]
    p, _ = tables(V, 2, 0.0, 0, 1.0, "far", 5)
    argmax_path = ()
    for _ in range(3):
        argmax_path += (int(p[argmax_path].argmax()),)
    for tokens in itertools.product(range(V), repeat=len(parents) - 1):
        toks = [0, *tokens]
        P = torch.stack([p[tuple(toks[u] for u in path_to(parents, v))] for v in range(len(parents))])[None]
        path, x = verify_tree_paths("greedy", parents, torch.tensor([toks]), P, None, [torch.Generator()])
        emitted = tuple(toks[v] for v in path[0].tolist() if v >= 0) + (int(x),)
        assert emitted == argmax_path[: len(emitted)], (toks, emitted)


def test_tree_exactness_check_catches_a_walk_that_skips_the_residual(monkeypatch):
    """A sequoia walk that forgets to renormalize q after a rejection (a plausible bug) is caught."""
    import redwood.sample.tree_verify as tv

    p, q = tables(4, 1, 1.0, 0, 1.0, "far", 9)
    parents = [-1, 0, 0, 0]
    real = tv.verify_tree_paths

    def buggy(verifier, *args):  # sequoia's children (drawn without replacement) checked by specinfer's rule
        return real("specinfer" if verifier == "sequoia" else verifier, *args)

    monkeypatch.setattr(tv, "verify_tree_paths", buggy)
    monkeypatch.setitem(globals(), "verify_tree_paths", buggy)
    with pytest.raises(AssertionError, match="emitted vs"):
        assert_joint_matches(tree_emission_stochastic("sequoia", parents, p, q), p, 2, "buggy")


# ------------------------------------------------------------------------------------------ draft side


@pytest.mark.parametrize("rule,k", [("swor", 1), ("replacement", 1), ("replacement", 3)])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0)])
def test_draft_draws_by_inverse_cdf_are_exact(rule, k, temperature, top_p):
    """A chain's draft token (swor with one child) and SpecInfer's children are drawn by inverse CDF:
    each token's lattice measure equals its probability to float64 rounding — the tail included (a
    vocabulary of 1,024 at T = 1 has 38 tokens below float32's 2^-24 spacing, down to 7e-10)."""
    V = 1024
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, V, generator=g) * 3.0
    q = probabilities(logits, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([top_p]))[0]
    xs = torch.arange(V)

    def beyond(kk):  # the j-th child (all k children drawn with the same uniform column)
        u = lattice(kk)[:, None].expand(V, k).contiguous()
        out = draw_children(q[None].expand(V, -1), k, rule, Scripted(u))
        assert (out == out[:, :1]).all()
        return out[:, 0] > xs

    F = first_true(beyond, V).double() / LATTICE
    measure = torch.diff(F, prepend=torch.zeros(1, dtype=torch.float64))
    want = q.double() / q.double().sum()
    assert float((measure - want).abs().max()) < 1e-15
    assert torch.all(measure[q == 0] == 0)


# ------------------------------------------------------------------------------------------ match


def _prefix_index(p: dict) -> tuple[dict, torch.Tensor]:
    """Every prefix of the tables → a row of one stacked table [prefixes, V]."""
    keys = list(p)
    return {k: i for i, k in enumerate(keys)}, torch.stack([p[k] for k in keys])


class MatchStep:
    """One match step on a tree (a chain included), driven by lattice uniforms: U [R, depth + 1] int64
    (the uniform of depth d is U[:, d] · 2^-53, shared by the target's draw at every node of depth d and
    the coupled draft of the children there). Drafts are drawn by `rule` through `draw_children`, and the
    target side runs `verify_match` (chain=True) or the tree walk."""

    def __init__(self, parents: list[int], p: dict, q: dict, rule: str, chain: bool = False):
        self.parents, self.rule, self.chain = parents, rule, chain
        self.kids = children_of(parents)
        self.paths = [path_to(parents, v) for v in range(len(parents))]
        self.depth = torch.tensor([len(x) for x in self.paths])
        self.index, self.P = _prefix_index(p)
        _, self.Q = _prefix_index(q)

    def tokens(self, U: torch.Tensor) -> torch.Tensor:
        """The drafted tree [R, n], breadth-first (a node's prefix is drawn before its children)."""
        R, n = U.shape[0], len(self.parents)
        toks = torch.zeros(R, n, dtype=torch.long)
        for v in range(n):
            if self.kids[v]:
                pre = self.prefix_rows(toks, v)
                u = lattice(U[:, len(self.paths[v])])  # the children's depth: the parent's + 1 → its uniform
                kids = draw_children(self.Q[pre], len(self.kids[v]), self.rule, None, uniforms=u)
                toks[:, self.kids[v]] = kids
        return toks

    def prefix_rows(self, toks: torch.Tensor, v: int) -> torch.Tensor:
        """The table row of node v's prefix (the tokens on its path) in each row [R]."""
        cols = toks[:, self.paths[v]].tolist()
        return torch.tensor([self.index[tuple(c)] for c in cols])

    def run(self, U: torch.Tensor, same_uniform: bool = False):
        """→ (tokens [R, n], path [R, max depth] −1 padded, next token [R])."""
        toks = self.tokens(U)
        R, n = toks.shape
        P = torch.stack([self.P[self.prefix_rows(toks, v)] for v in range(n)], dim=1)  # [R, n, V]
        node_u = lattice(U)[:, self.depth]  # [R, n]
        if same_uniform:  # a step keying every node by the root's position (a plausible bug)
            node_u = node_u[:, :1].expand(R, n)
        if not self.chain:
            path, nxt = verify_tree_paths("match", self.parents, toks, P, None, None, node_u)
            return toks, path, nxt
        a, nxt = verify_match(P, toks[:, 1:], node_u)
        j = torch.arange(1, n)[None]
        return toks, torch.where(j <= a[:, None], j, -1), nxt


def match_emission(step: MatchStep, same_uniform: bool = False) -> dict[tuple[int, ...], float]:
    """Exact emission probabilities of a match step. Depth by depth, each reached state (the lattice
    points of the depths before, a weight) splits its depth's uniform into the cells where both the
    target's token there and the coupled first child are constant — their breakpoints bisected from
    the code itself, per token x: the first k where the token exceeds x. In a cell the whole depth's
    outcome is constant (the other children are q's top tokens after the first): the walk descends to
    one child (a state of the next depth) or stops and emits its token."""
    V = step.P.shape[-1]
    D = int(step.depth.max())
    half = LATTICE // 2  # the deeper depths' uniforms, placeholders until their turn
    states = [([], 1.0)]  # (lattice points of depths < d, probability)
    emitted: dict[tuple[int, ...], float] = {}
    xs = torch.arange(V)
    for d in range(D + 1):
        if not states:
            break
        S = len(states)
        fixed = torch.tensor([u + [half] * (D + 1 - d) for u, _ in states]).repeat_interleave(V, dim=0)  # [S·V, D+1]

        def at(k, fixed=fixed, d=d):
            U = fixed.clone()
            U[:, d] = k
            return U

        def token_at_depth(U, d=d):  # the emitted token of index d: the accepted child's, or the next token
            toks, path, nxt = step.run(U, same_uniform)
            if d < path.shape[1]:
                moved = path[:, d] >= 0
                return torch.where(moved, toks.gather(1, path[:, d : d + 1].clamp(min=0))[:, 0], nxt)
            return nxt

        def first_child(U, d=d):
            toks, path, _ = step.run(U, same_uniform)
            v = path[:, d - 1].clamp(min=0) if d > 0 else torch.zeros(len(U), dtype=torch.long)
            kids = [step.kids[i][0] if step.kids[i] else 0 for i in v.tolist()]
            return toks[torch.arange(len(U)), kids]

        cuts = [first_true(lambda k: token_at_depth(at(k)) > xs.repeat(S), S * V)]
        if step.rule == "coupled":
            cuts.append(first_true(lambda k: first_child(at(k)) > xs.repeat(S), S * V))
        cuts = torch.cat([c.view(S, V) for c in cuts], dim=1)  # [S, cuts]
        nxt_states = []
        for s, (u_s, w) in enumerate(states):
            points = sorted({0, LATTICE, *cuts[s].tolist()})
            cells = [(lo, hi) for lo, hi in zip(points, points[1:]) if hi > lo]
            U = torch.tensor([u_s + [lo] + [half] * (D - d) for lo, _ in cells])
            toks, path, nxt = step.run(U, same_uniform)
            for i, (lo, hi) in enumerate(cells):
                mass = w * (hi - lo) / LATTICE
                if d < path.shape[1] and path[i, d] >= 0:
                    nxt_states.append((u_s + [lo], mass))
                else:
                    head = tuple(int(toks[i, v]) for v in path[i].tolist() if v >= 0)
                    emitted[head + (int(nxt[i]),)] = emitted.get(head + (int(nxt[i]),), 0.0) + mass
        states = nxt_states
    return emitted


MATCH_TREES = {**TREES, "chain-3 (verify_match)": TREES["chain-3"]}


@pytest.mark.parametrize("rule", ["coupled", "topk"])
@pytest.mark.parametrize("tree", list(MATCH_TREES))
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 3, 0.9), (1.5, 0, 0.8)])
def test_match_is_exact(rule, tree, temperature, top_k, top_p):
    """Coupled drafts use the very uniforms the target draws with, and still the emitted tokens follow
    the target exactly (drafts change how many tokens a step emits, never which)."""
    V = 4
    parents = MATCH_TREES[tree]
    depth = max(len(path_to(parents, v)) for v in range(len(parents)))
    p, q = tables(V, depth, temperature, top_k, top_p, "near", seed=31 + depth)
    step = MatchStep(parents, p, q, rule, chain="verify_match" in tree)
    emitted = match_emission(step)
    assert_joint_matches(emitted, p, depth + 1, f"match {rule} {tree} T={temperature} k={top_k} p={top_p}")


def test_match_exactness_check_catches_one_uniform_for_every_depth():
    """A step that keys every node by the root's position (one uniform for all depths) is caught."""
    p, q = tables(4, 2, 1.0, 0, 1.0, "near", 9)
    step = MatchStep(TREES["fork-2x2"], p, q, "coupled")
    with pytest.raises(AssertionError, match="emitted vs"):
        assert_joint_matches(match_emission(step, same_uniform=True), p, 3, "one uniform")


def test_match_at_temperature_zero_emits_the_greedy_walk():
    """One-hot target rows: whatever the uniforms, match emits what the greedy walk does."""
    V, parents = 4, TREES["wide-3+chain"]
    p, q = tables(V, 3, 0.0, 0, 1.0, "near", 5)
    step = MatchStep(parents, p, q, "coupled")
    U = torch.randint(0, LATTICE, (64, 4), generator=torch.Generator().manual_seed(0))
    toks, path, nxt = step.run(U)
    P = torch.stack([step.P[step.prefix_rows(toks, v)] for v in range(len(parents))], dim=1)
    g_path, g_nxt = verify_tree_paths("greedy", parents, toks, P, None, None)
    assert torch.equal(path, g_path) and torch.equal(nxt, g_nxt)
