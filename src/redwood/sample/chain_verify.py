"""Chain verifiers: which draft tokens a row accepts, and the token the target adds after them.

Terms: each step the draft proposes γ tokens d1…dγ; the target scores γ + 1 positions. A row *accepts*
a prefix d1…da (0 ≤ a ≤ γ) and then emits one more token from the target: the *correction* (resampled
at the first rejected position) or, when all γ are accepted, the *bonus* token. Either way a + 1
tokens are emitted per step.

The verifiers preserve the target's distribution exactly: `greedy` for temperature 0, `sampling`
(speculative rejection sampling) for any temperature / top-k / top-p, in float32, with fresh random
numbers for each row every step (from a device-side `RowRandom` or one generator per row), and `match`
(the target draws its own token at every position by inverse CDF with one given uniform per position;
drafts are accepted while they equal those tokens) for any temperature. None reads a device value on the
host, so all run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

from redwood.sample.random import inverse_cdf
from redwood.sample.tree_verify import per_row_uniforms


def verify_greedy(target_probs: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs: [B, γ+1, V] (one-hot for greedy rows; argmax is what matters); drafts: [B, γ].

    Returns accepted [B] (a) and next_token [B] (the target's argmax at position a).
    """
    best = target_probs.argmax(-1)  # [B, γ+1]
    match = (drafts == best[:, :-1]).long()
    accepted = match.cumprod(dim=1).sum(dim=1)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def verify_sampling(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor, rand
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling.

    target_probs p: [B, γ+1, V]; draft_probs q: [B, γ, V] (the distributions the drafts were drawn
    from); drafts: [B, γ]; rand: a `RowRandom` or one generator per row. Position i accepts d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn from
    normalize(max(p_i − q_i, 0)); if all are accepted it is drawn from p_γ+1. Returns accepted [B] and
    next_token [B].
    """
    B, gamma = drafts.shape
    p = target_probs.float()
    q = draft_probs.float()
    rows = torch.arange(B, device=p.device)
    # γ acceptance tests, then the correction / bonus draw; float64 (53-bit) uniforms, see inverse_cdf
    u = per_row_uniforms(rand, rows, (gamma + 1,), torch.float64, p.device)
    p_d = p[:, :-1].gather(2, drafts[..., None])[..., 0].double()  # [B, γ]
    q_d = q.gather(2, drafts[..., None])[..., 0].double()
    ok = (u[:, :gamma] * q_d < p_d).long()  # u < p/q without dividing (q_d > 0 for a drawn token)
    accepted = ok.cumprod(dim=1).sum(dim=1)  # [B]
    p_at = p[rows, accepted]  # [B, V] target distribution at the first unaccepted position
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q at position γ+1 is 0 → bonus from p
    residual = (p_at - q_pad[rows, accepted]).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # Rejection implies p(d) < q(d), hence mass > 0; guard against float round-off all the same.
    dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
    return accepted, inverse_cdf(dist, u[:, gamma])


def match_tokens(target_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The target's own token after every node: target_probs [B, n, V], u [B, n] float64 → y [B, n],
    y[b, i] = inverse_cdf(target_probs[b, i], u[b, i]) (the argmax where a row is one-hot: greedy)."""
    B, n, V = target_probs.shape
    return inverse_cdf(target_probs.reshape(B * n, V), u.reshape(B * n)).view(B, n)


def verify_match(
    target_probs: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Match verification: draft i is accepted while it equals the token the target draws itself.

    target_probs p: [B, γ+1, V]; drafts: [B, γ]; u: [B, γ+1] float64, u[:, i] the uniform of the token
    after position i of the chain (the engine gives the row seed's number at that token's absolute
    position, `Sampler.position_uniforms`). With y_i = inverse_cdf(p_i, u_i): accepted a = the length of
    the prefix where d_i == y_i, next token y_a. Returns accepted [B] and next_token [B]. No draft
    distribution is needed: whatever the drafts, the emitted tokens are y_0 … y_a.

    Exact. The step's (i + 1)-th emitted token, when there is one, is y_i: it is emitted only when
    d_1 … d_i were accepted, i.e. equal y_0 … y_{i−1}, so p_i is the target's distribution after the
    tokens actually emitted. And u_i is fresh: the prefix and the event that the walk reaches position i
    depend only on u_0 … u_{i−1} (and on drafts, which are drawn from those at most — a coupled draft
    d_j uses u_{j−1}), never on u_i, which is read for this one position only. So given everything
    emitted before, y_i ~ p_i: plain sampling, token by token. Drafts — even coupled ones
    (`draw_children`'s "coupled" rule) — change how many tokens a step emits, never which. With u the
    row seed's number at each position the step emits exactly the tokens autoregressive sampling with
    the same seed would, wherever the verify forward's logits equal the decode forward's.
    """
    y = match_tokens(target_probs.float(), u)  # [B, γ+1]
    accepted = (drafts == y[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    return accepted, y.gather(1, accepted[:, None])[:, 0]
