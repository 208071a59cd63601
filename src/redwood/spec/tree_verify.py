"""Tree verifiers: drawing a node's children on the draft side, and walking a scored tree on the target side.

Terms (the chain verifiers' vocabulary, extended to trees). A tree of n nodes is given by `parents`
(node 0 is the root, the last token already committed; every other node's parent has a smaller index and
the children of a node are contiguous, as in breadth-first numbering). At every node v:

- `p[v]` is the target's distribution of the token that follows node v (the target forward over the tree
  scores all n positions at once);
- `q[v]` is the draft distribution that node v's *children* were drawn from (meaningless at a leaf).

The walk starts at the root. At the current node it *accepts* at most one child and descends to it; when
no child is accepted (or the node is a leaf) it emits one more token from the target — the *correction*
(drawn from what is left of p after the rejections) or, at an untouched leaf, the *bonus* token drawn from
p itself. A row thus emits len(accepted path) + 1 tokens per step.

The verifiers and the child-drawing rule each one needs (§5 of the Sequoia reference):

=========  ====================  ==========================================================================
verifier   children drawn by     accept walk at a node
=========  ====================  ==========================================================================
sequoia    ``swor`` (without     children in draw order: accept x w.p. min(1, p(x)/q(x)); on rejection
           replacement)          p ← normalize(max(p − q, 0)), then x leaves q (renormalized); once q has
                                 no mass left, q is uniform over the tokens not yet tried at this node
specinfer  ``replacement``       the same loop, q never modified (duplicates are legal and re-tested)
greedy     ``topk``              accept the child equal to argmax p; the bonus is argmax p at the end
topk       ``topk``              draw y ~ p; accept the child equal to y, else emit y
=========  ====================  ==========================================================================

`sequoia`, `specinfer` and `topk` emit tokens distributed exactly as the target's p; `greedy` is exact for
temperature 0. The distributions must come from `redwood.engine.sampling.probabilities` (temperature, then
top-k, then top-p) for both models, and `q` must be the very distribution the children were drawn from.

Exhausted support (sequoia). If a node has more children than q has support, the draft side fills the
remaining children with distinct tokens drawn uniformly from the tokens not drawn yet, and the verifier,
once q's mass is used up, continues with q uniform over the untried tokens — the same rule on both sides,
which is what keeps the walk exact. Nothing ever turns NaN and nothing ends the sequence: every zero-mass
case (a residual that sums to 0 can only come from float round-off) falls back to a valid distribution.

Randomness. Every call draws fresh numbers from each row's own generator (one call per row per step), so
a row's result does not depend on what else is in the batch. All probability math is float32.
"""

from __future__ import annotations

import torch

VERIFIERS = ("sequoia", "specinfer", "greedy", "topk")
RULES = ("swor", "replacement", "topk")
CHILD_RULE = {"sequoia": "swor", "specinfer": "replacement", "greedy": "topk", "topk": "topk"}

# Keys given to tokens outside q's support when drawing without replacement: far below any key of a
# supported token (those are log q − log E ≥ −104 − 37 for float32 q and float64 uniforms).
_OUTSIDE_SUPPORT_KEY = -1.0e4


# ------------------------------------------------------------------------------------------ helpers


def _per_row_uniforms(generators: list[torch.Generator], rows: torch.Tensor, shape: tuple[int, ...],
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Fresh U[0, 1) numbers [N, *shape]: item i is drawn from generators[rows[i]].

    Items sharing a generator are drawn in one call, in item order (so the result is reproducible and
    independent of the other generators).
    """
    N = rows.numel()
    if N == 0:
        return torch.empty((0, *shape), dtype=dtype, device=device)
    order = torch.sort(rows.cpu(), stable=True)
    uniq, counts = torch.unique_consecutive(order.values, return_counts=True)
    drawn = [torch.rand((c, *shape), generator=generators[r], device=generators[r].device, dtype=dtype)
             for r, c in zip(uniq.tolist(), counts.tolist())]
    drawn = torch.cat([d.to(device) for d in drawn]) if len(drawn) > 1 else drawn[0].to(device)
    out = torch.empty_like(drawn)
    out[order.indices.to(device)] = drawn  # back from row-sorted order to item order
    return out


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from each row of probs [M, V] with uniforms u [M] or [M, k] → indices of u's shape.

    A token of probability 0 is never returned (its cumulative sum equals its predecessor's, so the first
    index whose cumulative sum exceeds the target value is never it; the end is clamped to the last token
    with mass). A row without mass is treated as uniform.
    """
    squeeze = u.dim() == 1
    if squeeze:
        u = u[:, None]
    mass = probs.sum(-1, keepdim=True)
    probs = torch.where(mass > 0, probs, torch.ones_like(probs))
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True)
    V = probs.shape[-1]
    last = (V - 1) - (probs > 0).flip(-1).float().argmax(-1, keepdim=True)
    idx = torch.minimum(idx, last)
    return idx[:, 0] if squeeze else idx


# ------------------------------------------------------------------------------------------ draft side


def draw_children(q: torch.Tensor, k: int, rule: str, generators: list[torch.Generator],
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Draw k children for each of N parent nodes.

    q: [N, V] draft distributions of the parents; rule: "swor" | "replacement" | "topk" (`CHILD_RULE`
    maps a verifier to its rule); generators: one per batch row; rows: [N] batch row of each node (None →
    node i uses generators[i]). Returns tokens [N, k] long, in draw order.

    - "swor": sampling without replacement by exponential keys (Gumbel-top-k): token t gets the key
      log q(t) − log E_t with E_t ~ Exp(1); the k largest keys, in decreasing order, are distributed as k
      sequential draws without replacement. Tokens with q = 0 are never drawn while q has support left;
      if k exceeds q's support, the remaining children are distinct tokens drawn uniformly (in random
      order) from those not drawn yet — the exhausted-support rule the `sequoia` verifier mirrors.
    - "replacement": k i.i.d. draws from q.
    - "topk": q's k most likely tokens (deterministic; ties go to the lower token id, as torch.argmax).
    """
    if rule not in RULES:
        raise ValueError(f"unknown child rule {rule!r}; expected one of {RULES}")
    if q.dim() != 2:
        raise ValueError(f"q must be [N, V], got {tuple(q.shape)}")
    N, V = q.shape
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    q = q.float()
    if rule == "topk":
        return torch.sort(q, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
    if rows is None:
        if len(generators) != N:
            raise ValueError(f"{N} nodes but {len(generators)} generators and no row index")
        rows = torch.arange(N)
    rows = torch.as_tensor(rows, dtype=torch.long).flatten()
    if rows.numel() != N:
        raise ValueError(f"rows has {rows.numel()} entries for {N} nodes")
    if rule == "replacement":
        u = _per_row_uniforms(generators, rows, (k,), torch.float32, q.device)
        return _inverse_cdf(q, u)
    # swor: keys in float64 so that ties (probability ~2^-53 per pair) are negligible.
    u = _per_row_uniforms(generators, rows, (V,), torch.float64, q.device)
    e = (-torch.log1p(-u)).clamp(min=1e-300)  # Exp(1)
    q64 = q.double()
    keys = torch.where(q64 > 0, q64.clamp(min=1e-300).log() - e.log(), _OUTSIDE_SUPPORT_KEY - e)
    return keys.topk(k, dim=-1, sorted=True).indices


# ------------------------------------------------------------------------------------------ tree shape


def _tree_index(parents: list[int]) -> tuple[list[int], list[int], int, int]:
    """(first child of each node (0 if none), number of children, maximum depth, maximum children)."""
    n = len(parents)
    if n == 0 or parents[0] >= 0:
        raise ValueError("parents[0] must be negative: node 0 is the root")
    start, count, depth = [0] * n, [0] * n, [0] * n
    for i in range(1, n):
        a = parents[i]
        if not 0 <= a < i:
            raise ValueError(f"node {i}: parent {a} must be an earlier node")
        if count[a] == 0:
            start[a] = i
        elif start[a] + count[a] != i:
            raise ValueError(f"children of node {a} are not contiguous (node {i})")
        count[a] += 1
        depth[i] = depth[a] + 1
    return start, count, max(depth), max(count)


# ------------------------------------------------------------------------------------------ target side


def verify_tree(verifier: str, parents: list[int], tokens: torch.Tensor, target_probs: torch.Tensor,
                draft_probs: torch.Tensor | None, generators: list[torch.Generator]
                ) -> tuple[list[list[int]], torch.Tensor]:
    """Walk a scored token tree for every row of a batch.

    verifier: "sequoia" | "specinfer" | "greedy" | "topk"; parents: [n] (parents[0] < 0; children
    contiguous); tokens: [B, n] node tokens (tokens[:, 0], the root, is not looked at); target_probs:
    [B, n, V] (p at each node: the target's distribution of the next token after it); draft_probs:
    [B, n, V] (q at each node: the distribution its children were drawn from, by `CHILD_RULE[verifier]`;
    unused, and may be None, for greedy and topk); generators: one per row.

    Returns (accepted_nodes, next_token): per row, the accepted path's node indices excluding the root
    (empty when no child of the root is accepted), and [B] the token emitted after the path (correction or
    bonus).

    Cost: the walk is vectorized over rows; Python loops run over depth × the widest node's child slots,
    each step a handful of [B, V] float32 operations (sequoia/specinfer recompute the residual for every
    slot). Random numbers take one generator call per row.
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; expected one of {VERIFIERS}")
    start_l, count_l, max_depth, max_children = _tree_index(list(parents))
    B, n = tokens.shape
    if n != len(parents):
        raise ValueError(f"tokens has {n} nodes, parents {len(parents)}")
    if target_probs.shape[:2] != (B, n):
        raise ValueError(f"target_probs must be [B={B}, n={n}, V], got {tuple(target_probs.shape)}")
    if len(generators) != B:
        raise ValueError(f"{B} rows but {len(generators)} generators")
    stochastic = verifier in ("sequoia", "specinfer")
    if stochastic and (draft_probs is None or draft_probs.shape != target_probs.shape):
        raise ValueError(f"{verifier} needs draft_probs shaped like target_probs {tuple(target_probs.shape)}")

    device = target_probs.device
    V = target_probs.shape[-1]
    tokens = tokens.to(device)
    child_start = torch.tensor(start_l, dtype=torch.long, device=device)
    child_count = torch.tensor(count_l, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)

    # u[:, 0, v]: the acceptance test of child v; u[:, 1, v]: a draw from p at node v (topk's y, or the
    # final correction/bonus). Each is used at most once per walk.
    if verifier == "greedy":
        u = None
    else:
        u = _per_row_uniforms(generators, torch.arange(B), (2, n), torch.float32, device)

    cur = torch.zeros(B, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)

    for level in range(max_depth + 1):
        if not bool(alive.any()):
            break
        p = target_probs[rows, cur].float()  # [B, V]
        start = child_start[cur]
        count = torch.where(alive, child_count[cur], torch.zeros_like(cur))
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        new_cur = cur.clone()

        if not stochastic:
            if verifier == "greedy":
                y = p.argmax(-1)
            else:
                y = _inverse_cdf(p, u[rows, 1, cur])
            for j in range(max_children):
                has = alive & ~moved & (j < count)
                if not bool(has.any()):
                    break
                child = (start + j).clamp(max=n - 1)
                hit = has & (tokens[rows, child] == y)
                new_cur = torch.where(hit, child, new_cur)
                moved |= hit
            done = alive & ~moved
            next_token = torch.where(done, y, next_token)
        else:
            q = draft_probs[rows, cur].float()
            untried = torch.ones(B, V, dtype=torch.bool, device=device)
            for j in range(max_children):
                active = alive & ~moved & (j < count)
                if not bool(active.any()):
                    break
                child = (start + j).clamp(max=n - 1)
                x = tokens[rows, child]
                px = p.gather(1, x[:, None])[:, 0]
                qx = q.gather(1, x[:, None])[:, 0]
                r = u[rows, 0, child]
                accept = active & (px > r * qx)  # probability min(1, p/q), no division
                new_cur = torch.where(accept, child, new_cur)
                moved |= accept
                reject = active & ~accept
                if not bool(reject.any()):
                    continue
                residual = (p - q).clamp(min=0)
                mass = residual.sum(-1, keepdim=True)
                # A rejection implies p ≠ q, so mass > 0 but for round-off; then keep p.
                residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
                p = torch.where(reject[:, None], residual, p)
                if verifier == "sequoia":
                    untried = untried & ~(reject[:, None] & (torch.arange(V, device=device) == x[:, None]))
                    q_left = q.scatter(1, x[:, None], 0.0)
                    q_mass = q_left.sum(-1, keepdim=True)
                    uniform = untried.float() / untried.sum(-1, keepdim=True).clamp(min=1)
                    q_left = torch.where(q_mass > 0, q_left / q_mass.clamp(min=1e-30), uniform)
                    q = torch.where(reject[:, None], q_left, q)
            done = alive & ~moved
            if bool(done.any()):
                drawn = _inverse_cdf(p, u[rows, 1, cur])
                next_token = torch.where(done, drawn, next_token)

        if level < max_depth:
            path[:, level] = torch.where(moved, new_cur, path[:, level])
        cur = new_cur
        alive = moved

    accepted = [[v for v in row if v >= 0] for row in path.tolist()]
    return accepted, next_token
