"""The speculative loop: draft → verify → commit, for a batch of independent rows.

State per row between steps: the target cache holds the committed tokens except the newest one, `last`
(sampled but not yet fed), and `prev` is the newest committed token. Each step:
    draft   the drafter proposes d1…dγ after `last` (and their distributions q);
    verify  one target forward over [last, d1…dγ] (γ + 1 positions, slots L…L+γ) gives p; the verifier
            picks a ≤ γ accepted drafts per row and the next token;
    commit  each active row keeps a + 1 of the written slots (last, d1…da); the rest are scratch that
            the next step overwrites. `last` becomes the next token.
Rows finish independently (EOS, stop strings, max_new_tokens); a finished row commits nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from redwood.engine.generate import cache_capacity, prefill
from redwood.engine.request import RequestState, SpecStats
from redwood.engine.sampling import Sampler
from redwood.models.transformer import Transformer
from redwood.spec.drafters import Drafter
from redwood.spec.verifiers import verify_greedy, verify_sampling


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def speculative(target: Transformer, drafter: Drafter, requests: list[RequestState], gamma: int,
                verifier: str = "auto") -> Iterator[list[int]]:
    """Generate for all requests with speculation; after each step yields the rows that got tokens."""
    device = target.device
    B = len(requests)
    sampler = Sampler([r.params for r in requests], device)
    use_greedy = verifier == "greedy" or (verifier == "auto" and sampler.all_greedy)
    capacity = cache_capacity(requests, extra=gamma + 1)
    prompts = [r.prompt_ids for r in requests]
    t0 = time.perf_counter()
    drafter.prefill(prompts, capacity)
    cache = target.new_cache(B, capacity)
    logits = prefill(target, cache, prompts, observer=drafter.target_prefill_observer())
    last = sampler.sample(logits)
    prev = torch.tensor([p[-1] for p in prompts], device=device)
    last_list = last.tolist()
    t1 = time.perf_counter()
    for r in requests:
        r.stats.prefill_s = t1 - t0
        r.stats.spec = SpecStats(gamma=gamma)
    for b, r in enumerate(requests):
        r.append(last_list[b])
    yield list(range(B))
    while not all(r.finished for r in requests):
        _sync(device)
        ta = time.perf_counter()
        drafts, q = drafter.propose(cache, prev, last, gamma, sampler)
        _sync(device)
        tb = time.perf_counter()
        ids = torch.cat([last[:, None], drafts], dim=1)  # [B, γ+1]
        positions = cache.lengths[:, None] + torch.arange(gamma + 1, device=device)
        logits = target(ids, positions, cache)  # [B, γ+1, V]
        p = sampler.probs(logits.reshape(B * (gamma + 1), -1),
                          torch.arange(B, device=device).repeat_interleave(gamma + 1)).view(B, gamma + 1, -1)
        if use_greedy:
            accepted, nxt = verify_greedy(p, drafts)
        else:
            accepted, nxt = verify_sampling(p, q, drafts, sampler.generators)
        prev = ids.gather(1, accepted[:, None])[:, 0]
        last = nxt
        acc_list, nxt_list, ids_list = accepted.tolist(), nxt.tolist(), ids.tolist()
        tc = time.perf_counter()
        updated = []
        # Slots each row commits: a + 1 (last, d1…da), fewer when the row finishes within the step (only
        # the tokens it emitted, so its cache holds exactly its output and its length never passes
        # prompt + max_new_tokens), none once finished.
        kept = [0] * B
        for b, r in enumerate(requests):
            if r.finished:
                continue
            updated.append(b)
            spec = r.stats.spec
            spec.record(acc_list[b])
            spec.draft_s += tb - ta
            spec.verify_s += tc - tb
            for tok in ids_list[b][1: acc_list[b] + 1] + [nxt_list[b]]:
                kept[b] += 1
                if r.append(tok):
                    r.stats.decode_s = time.perf_counter() - t1
                    break
        cache.commit(torch.tensor(kept, device=device))
        yield updated
