"""The device work of one decoding step over a batch of rows: autoregressive, or draft → verify.

State per row between steps: the target cache holds the committed tokens except the newest one, `last`
(sampled but not yet fed), and `prev` is the newest committed token. A step maps

    (prev [B], last [B]) → path [B, A], accepted [B], next token [B], new prev [B],
                           host [B, 2 + A] (accepted, next token, the path's tokens: one transfer),
                           logprobs (only when built with logprobs=True, else None)

logprobs: `token_logprobs` of the tokens the step emits — (chosen [B, A], top values [B, A, K], top ids
[B, A, K]): emitted token j of a row (j ≤ accepted) is scored by the target's logits at path node j
(the root for the first token; node j − 1's accepted child for the next). Positions past a row's
accepted count are meaningless. A step that no row wants logprobs from is built without them (the
Engine puts the flag in the step's CUDA-graph key) and costs nothing extra.

Positions: `last` sits at absolute position L = cache.lengths (the prompt's tokens are 0 … len − 1), so
the token after it — the one an AR step samples — is at L + 1, and the token after tree node v at
L + depth(v) + 1. Sampling and the `match` verifier key their uniforms by these positions
(`Sampler.position_uniforms`).

- `ARStep`: one target forward over `last`, the next token sampled from it (A = 1, accepted 0).
- `SpecStep`, for a token tree whose root is `last` (a chain of γ drafts is the tree with one child per
  node): the drafter fills the tree's other nodes (and their draft distributions q); one target forward
  over all n nodes (slots L…L+n−1, positions L + depth, the tree's ancestor mask) gives p at every node;
  the verifier picks each row's accepted path (a nodes below the root) and the next token (the
  correction, or the bonus after a fully accepted path).
Committing (moving the accepted path's KV into place, advancing lengths) is the Engine's: it knows which
rows generate and where each stops. Nothing in a step reads a device value on the host, so on CUDA a step
is captured whole into one graph.
"""

from __future__ import annotations

import torch

from redwood.errors import ConfigError
from redwood.models.transformer import Transformer
from redwood.sample.chain_verify import verify_greedy, verify_match, verify_sampling
from redwood.sample.sampler import Sampler, token_logprobs
from redwood.sample.tree_verify import CHILD_RULE, verify_tree_paths
from redwood.speculation.drafters import Drafter
from redwood.speculation.trees import Tree

# Chain verifiers are vectorized special cases of the tree walks: with one child per node, Sequoia's
# sampling without replacement and SpecInfer are both plain speculative rejection sampling.
STOCHASTIC = ("sampling", "sequoia", "specinfer")


def resolve_verifier(
    verifier: str, tree: Tree, all_greedy: bool, noise: str = "position", deterministic: bool = False
) -> str:
    """The verifier to run: 'auto' → greedy when every request is greedy; else, on a chain, match where the
    sampler's noise is keyed by position (a seeded request's tokens then do not depend on how it speculates,
    for ~2% fewer accepted tokens than rejection sampling at γ 3 — benchmarks/results/2026-12-05-cpu-match;
    nothing at all for draftless one-token proposals) and rejection sampling under counter noise; on a tree,
    Sequoia's sampling without replacement — or, for a tree of deterministic children (`deterministic`:
    `Drafter.deterministic_children`, draftless drafters: no q they were drawn from), match / topk (both take
    the child equal to the target's own draw). Sequoia's and SpecInfer's walks need that q: for such a tree
    they are a ConfigError. 'match' → greedy when every request is greedy (the same tokens: both follow the
    target's argmax)."""
    if deterministic and not tree.is_chain and verifier in STOCHASTIC:
        raise ConfigError(
            f"the {verifier!r} verifier needs the draft distribution a tree's children were drawn from; this "
            f"drafter's children are deterministic (draftless): verify its tree with 'match' or 'topk' (any "
            f"temperature), 'greedy' (temperature 0) or 'auto'"
        )
    if verifier == "auto":
        if all_greedy:
            return "greedy"
        if not tree.is_chain:
            return ("match" if noise == "position" else "topk") if deterministic else "sequoia"
        return "match" if noise == "position" else "sampling"
    if verifier == "match":
        return "greedy" if all_greedy else "match"
    if verifier == "greedy" and not all_greedy:
        raise ConfigError(
            "the greedy verifier is lossless only at temperature 0; use verifier='sampling' "
            "(or 'sequoia' / 'specinfer' / 'topk' for trees, or 'auto') for sampled requests"
        )
    if verifier == "sampling" and not tree.is_chain:
        return "sequoia"
    return verifier


def child_rule(kind: str) -> str:
    """How a drafter draws children for verifier `kind`."""
    return "topk" if kind == "greedy" else ("swor" if kind == "sampling" else CHILD_RULE[kind])


def _verify(
    kind: str,
    tree: Tree,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    sampler: Sampler,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ path [B, A] (root then accepted nodes, padded with 0), accepted count a [B], next token [B].

    p: [B, n, V] target probabilities (for the greedy verifier, logits do as well: only argmax matters);
    u: match only, [B, n] float64 — the uniform of the token after each node.
    """
    B, n = tokens.shape
    if tree.is_chain and n > 1 and kind in ("greedy", "match", *STOCHASTIC):  # (no drafts: the tree walk)
        drafts = tokens[:, 1:]
        if kind == "greedy":
            a, nxt = verify_greedy(p, drafts)
        elif kind == "match":
            a, nxt = verify_match(p, drafts, u)
        else:
            a, nxt = verify_sampling(p, q[:, :-1], drafts, sampler.random)
        return torch.arange(n, device=tokens.device)[None].expand(B, n), a, nxt
    walk = "sequoia" if kind == "sampling" else kind
    nodes, nxt = verify_tree_paths(walk, list(tree.parents), tokens, p, q, sampler.random, u)  # [B, depth]
    path = torch.cat([nodes.new_zeros(B, 1), nodes.clamp(min=0)], dim=1)
    return path, (nodes >= 0).sum(1), nxt


class ARStep:
    """One autoregressive step: feed `last`, sample the next token."""

    def __init__(self, runner, sampler: Sampler, logprobs: bool = False):
        self.runner, self.sampler, self.logprobs = runner, sampler, logprobs

    def __call__(self, prev: torch.Tensor, last: torch.Tensor) -> tuple:
        positions = self.runner.cache.lengths[:, None]  # [B, 1]: `last`'s
        logits = self.runner.forward(last[:, None], positions)[:, 0]
        nxt = self.sampler.sample(logits, positions[:, 0] + 1)  # (the token after `last`)
        zeros = torch.zeros_like(last)
        host = torch.stack([zeros, nxt, last], dim=1)
        lp = token_logprobs(logits[:, None], nxt[:, None]) if self.logprobs else None
        return zeros[:, None], zeros, nxt, last, host, lp


class SpecStep:
    """One speculative step for a fixed batch, tree and verifier (see the module docstring)."""

    def __init__(
        self,
        target: Transformer,
        runner,
        draft_runner,
        drafter: Drafter,
        tree: Tree,
        kind: str,
        sampler: Sampler,
        logprobs: bool = False,
    ):
        self.runner, self.draft_runner, self.drafter, self.tree = runner, draft_runner, drafter, tree
        self.kind, self.rule, self.sampler, self.logprobs = kind, child_rule(kind), sampler, logprobs
        self.need_q = kind in STOCHASTIC
        device = target.device
        self.mask = None if tree.is_chain else tree.ancestor_mask(device)
        self.depth = tree.depths_tensor(device)

    def draft(self, prev: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.drafter.propose(
            self.runner, self.draft_runner, prev, last, self.tree, self.sampler, self.rule, self.need_q
        )

    def verify(self, tokens: torch.Tensor, q: torch.Tensor | None) -> tuple:
        B, n = tokens.shape
        positions = self.runner.cache.lengths[:, None] + self.depth[None]
        logits = self.runner.forward(tokens, positions, new_mask=self.mask, mask_key=("verify", self.tree))
        if self.kind == "greedy":
            p = logits  # [B, n, V]: argmax is all the greedy verifier reads
        else:
            rows = torch.arange(B, device=tokens.device).repeat_interleave(n)
            p = self.sampler.probs(logits.reshape(B * n, -1), rows).view(B, n, -1)
        # match: the uniform of the token after each node, keyed by that token's position
        u = self.sampler.position_uniforms(positions + 1) if self.kind == "match" else None  # [B, n]
        path, accepted, nxt = _verify(self.kind, self.tree, tokens, p, q, self.sampler, u)
        path_tokens = tokens.gather(1, path)  # [B, A]
        prev = path_tokens.gather(1, accepted[:, None])[:, 0]
        host = torch.cat([accepted[:, None], nxt[:, None], path_tokens], dim=1)
        lp = self._logprobs(logits, path, path_tokens, accepted, nxt) if self.logprobs else None
        return path, accepted, nxt, prev, host, lp

    def _logprobs(self, logits, path, path_tokens, accepted, nxt) -> tuple[torch.Tensor, ...]:
        """logits [B, n, V]; path / path_tokens [B, A] → `token_logprobs` of the emitted tokens."""
        B, A = path.shape
        if self.tree.is_chain:  # path node j is node j (up to the accepted count; the rest is padding)
            at_path = logits
        else:
            at_path = logits[torch.arange(B, device=path.device)[:, None], path]  # [B, A, V]
        # emitted j: the accepted child path_tokens[:, j + 1] for j < accepted, then the next token
        after = torch.cat([path_tokens[:, 1:], nxt[:, None]], dim=1)
        j = torch.arange(A, device=path.device)[None]
        emitted = torch.where(j == accepted[:, None], nxt[:, None], after)
        return token_logprobs(at_path, emitted)

    def __call__(self, prev: torch.Tensor, last: torch.Tensor) -> tuple:
        return self.verify(*self.draft(prev, last))
