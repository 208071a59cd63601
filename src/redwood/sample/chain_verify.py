"""Chain verifiers: which draft tokens a row accepts, and the token the target adds after them.

Terms: each step the draft proposes γ tokens d1…dγ; the target scores γ + 1 positions. A row *accepts*
a prefix d1…da (0 ≤ a ≤ γ) and then emits one more token from the target: the *correction* (resampled
at the first rejected position) or, when all γ are accepted, the *bonus* token. Either way a + 1
tokens are emitted per step.

Both verifiers preserve the target's distribution exactly: `greedy` for temperature 0, `sampling`
(speculative rejection sampling) for any temperature / top-k / top-p, in float32, with fresh random
numbers for each row every step (from a device-side `RowRandom` or one generator per row). Neither reads
a device value on the host, so both run inside a captured CUDA graph.
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
