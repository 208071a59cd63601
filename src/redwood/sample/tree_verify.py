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
match      ``coupled`` (any      y = inverse_cdf(p, u_d), u_d the uniform of the node's depth d (the engine:
           rule is exact)        the row seed's number at the absolute position of the token after the
                                 node); accept the child equal to y, else emit y
=========  ====================  ==========================================================================

`sequoia`, `specinfer`, `topk` and `match` emit tokens distributed exactly as the target's p; `greedy` is
exact for temperature 0. `match` is `topk` with its uniforms keyed by depth instead of drawn per node: it
emits the target's own draws y along the path it walks, so with the row seed's positional numbers it
emits exactly what autoregressive sampling with that seed would (`chain_verify.verify_match` argues the
exactness). Its ``coupled`` children draw the first child from q with that same uniform, which makes it
equal y when q's and p's inverse CDFs agree there (acceptance near the overlap of p and q where their
cumulative sums align), and fill the other children with q's most likely remaining tokens. The distributions must come from `redwood.sample.sampler.probabilities` (temperature, then
top-k, then top-p) for both models, and `q` must be the very distribution the children were drawn from.

Exhausted support (sequoia). If a node has more children than q has support, the draft side fills the
remaining children with distinct tokens drawn uniformly from the tokens not drawn yet, and the verifier,
once q's mass is used up, continues with q uniform over the untried tokens — the same rule on both sides,
which is what keeps the walk exact. Nothing ever turns NaN and nothing ends the sequence: every zero-mass
case (a residual that sums to 0 can only come from float round-off) falls back to a valid distribution.

Randomness. `rand` is either a list of `torch.Generator`s, one per batch row, or a `RowRandom`
(counter-based, drawn on the device — what the engine uses, so that a whole speculative step can be
captured in a CUDA graph). Every call draws fresh numbers for each row, so a row's result does not depend
on what else is in the batch; `match` reads the uniforms it is given (one per depth) instead. Probability math is float32; uniforms (53-bit) and the comparisons with
them are float64 (`inverse_cdf`).

Host synchronization. The walks never read a device value on the host while a CUDA graph is being
captured (their early exits are skipped then), and `verify_tree_paths` returns tensors.
"""

from __future__ import annotations

import torch

from redwood.sample.random import RowRandom, inverse_cdf

VERIFIERS = ("sequoia", "specinfer", "greedy", "topk", "match")
RULES = ("swor", "replacement", "topk", "coupled")
CHILD_RULE = {"sequoia": "swor", "specinfer": "replacement", "greedy": "topk", "topk": "topk", "match": "coupled"}

# Keys given to tokens outside q's support when drawing without replacement: far below any key of a
# supported token (those are log q − log E ≥ −104 − 37 for float32 q and float64 uniforms).
_OUTSIDE_SUPPORT_KEY = -1.0e4


# ------------------------------------------------------------------------------------------ helpers


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _any(mask: torch.Tensor) -> bool:
    """mask.any() for an early exit — True (no exit, no host sync) while a CUDA graph is captured."""
    return True if _capturing() else bool(mask.any())


def per_row_uniforms(
    rand, rows: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Fresh U[0, 1) numbers [N, *shape] on `device`: item i is drawn for batch row rows[i].

    rand: a `RowRandom`, or generators (one per row): items sharing a generator are drawn in one call, in
    item order (so the result is reproducible and independent of the other generators).
    """
    if isinstance(rand, RowRandom):
        return rand.uniform(rows, shape, dtype).to(device)
    generators = rand
    N = rows.numel()
    if N == 0:
        return torch.empty((0, *shape), dtype=dtype, device=device)
    order = torch.sort(rows.cpu(), stable=True)
    uniq, counts = torch.unique_consecutive(order.values, return_counts=True)
    drawn = [
        torch.rand((c, *shape), generator=generators[r], device=generators[r].device, dtype=dtype)
        for r, c in zip(uniq.tolist(), counts.tolist())
    ]
    drawn = torch.cat([d.to(device) for d in drawn]) if len(drawn) > 1 else drawn[0].to(device)
    out = torch.empty_like(drawn)
    out[order.indices.to(device)] = drawn  # back from row-sorted order to item order
    return out


# ------------------------------------------------------------------------------------------ draft side


def _top_k_low_index_first(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row of float32 x [N, V], in decreasing order, ties to the
    lower index — as a stable descending sort would give, but by one top-k over int64 keys (order-
    preserving float bits above the reversed index), much cheaper than sorting the vocabulary."""
    V = x.shape[-1]
    shift = max(1, (V - 1).bit_length())
    bits = x.contiguous().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order == float order (−0 < +0)
    keys = (ordered << shift) | (V - 1 - torch.arange(V, device=x.device))
    return keys.topk(k, dim=-1, sorted=True).indices


def draw_children(
    q: torch.Tensor,
    k: int,
    rule: str,
    rand,
    rows: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw k children for each of N parent nodes.

    q: [N, V] draft distributions of the parents; rule: "swor" | "replacement" | "topk" | "coupled"
    (`CHILD_RULE` maps a verifier to its rule); rand: a `RowRandom`, or generators, one per batch row;
    rows: [N] batch row of each node (None → node i is row i); uniforms: [N] float64, for "coupled" only
    (None: fresh ones from rand). Returns tokens [N, k] long, in draw order.

    - "swor": sampling without replacement by exponential keys (Gumbel-top-k): token t gets the key
      log q(t) − log E_t with E_t ~ Exp(1); the k largest keys, in decreasing order, are distributed as k
      sequential draws without replacement. Tokens with q = 0 are never drawn while q has support left;
      if k exceeds q's support, the remaining children are distinct tokens drawn uniformly (in random
      order) from those not drawn yet — the exhausted-support rule the `sequoia` verifier mirrors.
    - "replacement": k i.i.d. draws from q.
    - "topk": q's k most likely tokens (deterministic; ties go to the lower token id, as torch.argmax).
    - "coupled" (for `match`): the first child is inverse_cdf(q, uniforms) — given the uniform the
      target will draw its own token at the children's position with, it couples the two draws — and
      the other k − 1 are q's most likely tokens after it (distinct, deterministic: a tree's extra
      children cover the target's likely tokens where the coupled draw missed). A greedy row's q is
      one-hot, so its first child is the argmax, as with "topk".
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
        if k == 1:
            return q.argmax(-1, keepdim=True)  # (first index on ties)
        return _top_k_low_index_first(q, k)
    if rule == "coupled" and uniforms is not None:
        return _coupled_children(q, k, uniforms.to(q.device))
    if rows is None:
        if not isinstance(rand, RowRandom) and len(rand) != N:
            raise ValueError(f"{N} nodes but {len(rand)} generators and no row index")
        rows = torch.arange(N, device=q.device)
    rows = torch.as_tensor(rows, dtype=torch.long).flatten()
    if rows.numel() != N:
        raise ValueError(f"rows has {rows.numel()} entries for {N} nodes")
    if rule == "coupled":
        return _coupled_children(q, k, per_row_uniforms(rand, rows, (), torch.float64, q.device))
    if rule == "replacement" or k == 1:  # (one draw without replacement is a plain draw from q)
        u = per_row_uniforms(rand, rows, (k,), torch.float64, q.device)
        return inverse_cdf(q, u)
    # swor: keys in float64 so that ties (probability ~2^-53 per pair) are negligible.
    u = per_row_uniforms(rand, rows, (V,), torch.float64, q.device)
    e = (-torch.log1p(-u)).clamp(min=1e-300)  # Exp(1)
    q64 = q.double()
    keys = torch.where(q64 > 0, q64.clamp(min=1e-300).log() - e.log(), _OUTSIDE_SUPPORT_KEY - e)
    return keys.topk(k, dim=-1, sorted=True).indices


def _coupled_children(q: torch.Tensor, k: int, u: torch.Tensor) -> torch.Tensor:
    """q [N, V] float32, u [N] float64 → [N, k]: inverse_cdf(q, u), then q's k − 1 most likely others."""
    first = inverse_cdf(q, u)[:, None]  # [N, 1]
    if k == 1:
        return first
    rest = q.scatter(1, first, -1.0)  # (below every probability: never among the top k − 1)
    return torch.cat([first, _top_k_low_index_first(rest, k - 1)], dim=1)


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


# Device copies of tree indices, kept for the process's lifetime: a captured CUDA graph reads them on every
# replay (and a capture cannot copy host data to the device).
_INDEX_TENSORS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _index_tensors(parents: tuple[int, ...], start: list[int], count: list[int], device: torch.device):
    key = (parents, str(device))
    if key not in _INDEX_TENSORS:
        _INDEX_TENSORS[key] = (
            torch.tensor(start, dtype=torch.long, device=device),
            torch.tensor(count, dtype=torch.long, device=device),
        )
    return _INDEX_TENSORS[key]


def _depth_tensor(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each node's depth [n] on `device` (kept, as `_index_tensors`)."""
    key = (parents, str(device), "depth")
    if key not in _INDEX_TENSORS:
        depth = [0] * len(parents)
        for v in range(1, len(parents)):
            depth[v] = depth[parents[v]] + 1
        _INDEX_TENSORS[key] = torch.tensor(depth, dtype=torch.long, device=device)
    return _INDEX_TENSORS[key]


# ------------------------------------------------------------------------------------------ target side


def _match_uniforms(parents, max_depth: int, node_uniforms, rand, B: int, device) -> torch.Tensor:
    """match's uniforms in the walk's layout [B, 2, n] (only [:, 1] is read): the given node uniforms, or
    one fresh uniform per depth (drawn in one call) spread over that depth's nodes."""
    n = len(parents)
    if node_uniforms is None:
        per_depth = per_row_uniforms(rand, torch.arange(B, device=device), (max_depth + 1,), torch.float64, device)
        node_uniforms = per_depth[:, _depth_tensor(tuple(parents), device)]  # [B, n]
    if node_uniforms.shape != (B, n):
        raise ValueError(f"node_uniforms must be [B={B}, n={n}], got {tuple(node_uniforms.shape)}")
    return node_uniforms.to(device, torch.float64)[:, None].expand(B, 2, n)


def verify_tree(
    verifier: str,
    parents: list[int],
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rand,
    node_uniforms: torch.Tensor | None = None,
) -> tuple[list[list[int]], torch.Tensor]:
    """`verify_tree_paths` with the accepted paths as Python lists (one host sync)."""
    path, next_token = verify_tree_paths(verifier, parents, tokens, target_probs, draft_probs, rand, node_uniforms)
    return [[v for v in row if v >= 0] for row in path.tolist()], next_token


def verify_tree_paths(
    verifier: str,
    parents: list[int],
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    rand,
    node_uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk a scored token tree for every row of a batch.

    verifier: "sequoia" | "specinfer" | "greedy" | "topk" | "match"; parents: [n] (parents[0] < 0;
    children contiguous); tokens: [B, n] node tokens (tokens[:, 0], the root, is not looked at);
    target_probs: [B, n, V] (p at each node: the target's distribution of the next token after it);
    draft_probs: [B, n, V] (q at each node: the distribution its children were drawn from, by
    `CHILD_RULE[verifier]`; unused, and may be None, for greedy, topk and match); rand: a `RowRandom` or
    one generator per row (None: for a walk that draws nothing — greedy, or match given node_uniforms);
    node_uniforms: match only, [B, n] float64, the uniform y is drawn with at each
    node — the same for every node of one depth (the engine: the row seed's number at the position of the
    token after the node); None: one fresh uniform per depth from rand.

    Returns (path, next_token): path [B, max depth] the accepted path's node indices excluding the root,
    in order, padded with −1 (a row that accepts no child of the root is all −1), and [B] the token
    emitted after the path (correction or bonus).

    Cost: the walk is vectorized over rows; Python loops run over depth × the widest node's child slots,
    each step a handful of [B, V] float32 operations (sequoia/specinfer recompute the residual for every
    slot; sequoia updates q only where a later sibling can read it). The correction / bonus draw runs
    once, after the walk, from each row's final distribution (inside a CUDA graph the walk cannot exit
    early, so a draw per level would run at every level). Random numbers take one generator call per row.
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; expected one of {VERIFIERS}")
    start_l, count_l, max_depth, max_children = _tree_index(list(parents))
    B, n = tokens.shape
    if n != len(parents):
        raise ValueError(f"tokens has {n} nodes, parents {len(parents)}")
    if target_probs.shape[:2] != (B, n):
        raise ValueError(f"target_probs must be [B={B}, n={n}, V], got {tuple(target_probs.shape)}")
    if rand is not None and not isinstance(rand, RowRandom) and len(rand) != B:
        raise ValueError(f"{B} rows but {len(rand)} generators")
    stochastic = verifier in ("sequoia", "specinfer")
    if stochastic and (draft_probs is None or draft_probs.shape != target_probs.shape):
        raise ValueError(f"{verifier} needs draft_probs shaped like target_probs {tuple(target_probs.shape)}")

    device = target_probs.device
    V = target_probs.shape[-1]
    tokens = tokens.to(device)
    child_start, child_count = _index_tensors(tuple(parents), start_l, count_l, device)
    rows = torch.arange(B, device=device)

    # u[:, 0, v]: the acceptance test of child v; u[:, 1, v]: a draw from p at node v (topk's / match's
    # y, or the final correction/bonus). Each is used at most once per walk.
    if verifier == "greedy":
        u = None
    elif verifier == "match":
        u = _match_uniforms(parents, max_depth, node_uniforms, rand, B, device)
    else:
        u = per_row_uniforms(rand, torch.arange(B, device=device), (2, n), torch.float64, device)

    cur = torch.zeros(B, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    if stochastic:  # each row's final distribution and uniform, drawn from once after the walk
        p_end = torch.zeros(B, V, dtype=torch.float32, device=device)
        u_end = torch.zeros(B, dtype=torch.float64, device=device)

    for level in range(max_depth + 1):
        if not _any(alive):
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
                y = inverse_cdf(p, u[rows, 1, cur])
            for j in range(max_children):
                has = alive & ~moved & (j < count)
                if not _any(has):
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
                if not _any(active):
                    break
                child = (start + j).clamp(max=n - 1)
                x = tokens[rows, child]
                px = p.gather(1, x[:, None])[:, 0]
                qx = q.gather(1, x[:, None])[:, 0]
                r = u[rows, 0, child]
                accept = active & (px.double() > r * qx.double())  # probability min(1, p/q), no division
                new_cur = torch.where(accept, child, new_cur)
                moved |= accept
                reject = active & ~accept
                if not _any(reject):
                    continue
                residual = (p - q).clamp(min=0)
                mass = residual.sum(-1, keepdim=True)
                # A rejection implies p ≠ q, so mass > 0 but for round-off; then keep p.
                residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
                p = torch.where(reject[:, None], residual, p)
                if verifier == "sequoia" and j + 1 < max_children:  # q matters only to a later sibling
                    untried = untried & ~(reject[:, None] & (torch.arange(V, device=device) == x[:, None]))
                    q_left = q.scatter(1, x[:, None], 0.0)
                    q_mass = q_left.sum(-1, keepdim=True)
                    uniform = untried.float() / untried.sum(-1, keepdim=True).clamp(min=1)
                    q_left = torch.where(q_mass > 0, q_left / q_mass.clamp(min=1e-30), uniform)
                    q = torch.where(reject[:, None], q_left, q)
            # a row that stops here emits its correction / bonus from what is left of p: keep p and the
            # row's uniform, draw once after the walk (every row stops at exactly one level)
            done = alive & ~moved
            p_end = torch.where(done[:, None], p, p_end)
            u_end = torch.where(done, u[rows, 1, cur], u_end)

        if level < max_depth:
            path[:, level] = torch.where(moved, new_cur, path[:, level])
        cur = new_cur
        alive = moved

    if stochastic:
        next_token = inverse_cdf(p_end, u_end)
    return path, next_token
