"""Drafters: propose γ tokens per row (and the distributions they were drawn from).

- `SelfDrafter`: the target drafts for itself, reading its own cache through a compressed view
  (StreamingLLM / SnapKV). Its draft tokens' KV goes to the target cache's scratch slots, which the
  verification forward then overwrites with the target's exact KV — so no second cache and no catch-up.
- `ModelDrafter`: a small standalone model with its own cache, read through the same policies.
  Each step it rewinds its cache to the target's committed length − 1 and feeds the last committed token
  together with the newest one: that refreshes the one token it may not have seen (after a step that
  accepted all γ drafts) with a batch shape that is the same for every row.

Draft tokens are drawn from the same processed distribution (temperature / top-k / top-p) the verifier
compares against; greedy rows take the argmax.
"""

from __future__ import annotations

import torch

from redwood.engine.sampling import Sampler
from redwood.errors import ConfigError
from redwood.kv.cache import KVCache
from redwood.kv.policies import DraftKVPolicy
from redwood.models.transformer import Transformer


def draw(probs: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """One token per row from probs [B, V] with each row's generator (argmax for greedy rows)."""
    if sampler.all_greedy:
        return probs.argmax(-1)
    out = probs.argmax(-1)
    for b, p in enumerate(sampler.params):
        if not p.greedy:
            out[b] = torch.multinomial(probs[b], 1, generator=sampler.generators[b])[0]
    return out


class Drafter:
    policy: DraftKVPolicy

    def target_prefill_observer(self):
        """Observer to pass to the target's prefill (self-speculation with SnapKV), else None."""
        return None

    def prefill(self, prompts: list[list[int]], capacity: int) -> None:
        """Prepare for a new batch; called just before the target's prefill."""

    def propose(self, target_cache: KVCache, prev: torch.Tensor, last: torch.Tensor, gamma: int,
                sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft γ tokens after `last` [B] (not yet in any cache; `prev` [B] is the last committed token).

        Returns drafts [B, γ] and their distributions q [B, γ, V_target].
        """
        raise NotImplementedError


class SelfDrafter(Drafter):
    def __init__(self, model: Transformer, policy: DraftKVPolicy):
        self.model, self.policy = model, policy

    def target_prefill_observer(self):
        return self.policy.prefill_observer()

    def prefill(self, prompts, capacity):
        lens = torch.tensor([len(p) for p in prompts], device=self.model.device)
        self.policy.start(lens, self.model.config.num_layers)

    def propose(self, target_cache, prev, last, gamma, sampler):
        view = self.policy.view(target_cache.lengths)
        tok, drafts, qs = last, [], []
        for i in range(gamma):
            positions = (target_cache.lengths + i)[:, None]
            logits = self.model(tok[:, None], positions, target_cache, pending=i, view=view)[:, 0]
            q = sampler.probs(logits)
            tok = draw(q, sampler)
            drafts.append(tok)
            qs.append(q)
        return torch.stack(drafts, 1), torch.stack(qs, 1)


class ModelDrafter(Drafter):
    def __init__(self, model: Transformer, policy: DraftKVPolicy, target_vocab: int):
        self.model, self.policy = model, policy
        self.target_vocab = target_vocab
        # Tokens the two models share; the draft never proposes a token outside this range.
        self.shared_vocab = min(target_vocab, model.config.vocab_size)
        self.cache: KVCache | None = None

    def prefill(self, prompts, capacity):
        from redwood.engine.generate import prefill

        self.cache = self.model.new_cache(len(prompts), capacity)
        lens = torch.tensor([len(p) for p in prompts], device=self.model.device)
        self.policy.start(lens, self.model.config.num_layers)
        prefill(self.model, self.cache, prompts, observer=self.policy.prefill_observer())

    def _probs(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        q = sampler.probs(logits[:, : self.shared_vocab])
        if self.shared_vocab < self.target_vocab:
            q = torch.cat([q, q.new_zeros(q.shape[0], self.target_vocab - self.shared_vocab)], dim=1)
        return q

    def propose(self, target_cache, prev, last, gamma, sampler):
        assert self.cache is not None
        cache = self.cache
        cache.lengths.copy_(target_cache.lengths - 1)  # rewind: re-feed the last committed token
        view = self.policy.view(cache.lengths)
        ids = torch.stack([prev, last], 1)
        positions = cache.lengths[:, None] + torch.arange(2, device=ids.device)
        logits = self.model(ids, positions, cache, view=view)[:, 1]
        drafts, qs = [], []
        for i in range(gamma):
            if i > 0:
                positions = (cache.lengths + 1 + i)[:, None]
                logits = self.model(drafts[-1][:, None], positions, cache, pending=i + 1, view=view)[:, 0]
            q = self._probs(logits, sampler)
            drafts.append(draw(q, sampler))
            qs.append(q)
        return torch.stack(drafts, 1), torch.stack(qs, 1)


def check_compatible(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """A draft must share the target's tokenizer (on the shared id range) — else a clear error."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    shared = min(target_vocab, draft_vocab)
    t_items = {tok: i for tok, i in tv.items() if i < shared}
    d_items = {tok: i for tok, i in dv.items() if i < shared}
    if t_items != d_items:
        differing = sorted(set(t_items.items()) ^ set(d_items.items()), key=lambda x: x[1])[:3]
        raise ConfigError(
            "the draft model's tokenizer differs from the target's (speculation needs the same token ids); "
            f"e.g. {differing}"
        )
