"""Test helpers: drive an Engine over loaded models and keep what each request left in the caches.

`run_engine` adds requests at chosen steps (continuous batching), aborts some mid-way, steps until all
are done, and snapshots every request's committed KV (target and draft caches, read through the page
table) at the moment its slot is vacated — the only moment the cache still holds it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from redwood.engine.engine import Engine
from redwood.engine.prefill import prefill_row
from redwood.sampling_params import SamplingParams


@dataclass
class Snapshot:
    length: int  # committed slots of the target row
    k: torch.Tensor  # [layers, Hkv, length, D]
    v: torch.Tensor
    draft_length: int | None = None
    draft_k: torch.Tensor | None = None
    draft_v: torch.Tensor | None = None


def _read(cache, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    one = cache.row(row)
    ks, vs = zip(*(one.context(layer, max(n, 1)) for layer in range(cache.k.shape[0])))
    return torch.stack(ks)[:, 0, :, :n].clone(), torch.stack(vs)[:, 0, :, :n].clone()


class RecordingEngine(Engine):
    """An Engine that snapshots each request's KV when its slot is vacated (finish, abort, preemption)."""

    def _vacate(self, rec):
        if rec.slot is not None:
            L = int(self.cache.lengths[rec.slot])
            k, v = _read(self.cache, rec.slot, L)
            snap = Snapshot(L, k, v)
            if self.draft_cache is not None:
                DL = int(self.draft_cache.lengths[rec.slot])
                snap.draft_length = DL
                snap.draft_k, snap.draft_v = _read(self.draft_cache, rec.slot, DL)
            self.snapshots.setdefault(rec.seq.request_id, []).append(snap)
        super()._vacate(rec)


def run_engine(
    model,
    tokenizer,
    prompts,
    params,
    *,
    drafter=None,
    tree=None,
    verifier="auto",
    configure=None,
    arrivals=None,
    aborts=None,
    max_num_seqs=None,
    block_size=16,
    kv_cache_memory=None,
    max_num_batched_tokens=2048,
    enable_prefix_caching=False,
    prefill_first=False,
    engine=None,
    on_step=None,
):
    """Run prompts through one Engine. params: one SamplingParams or one per prompt. arrivals[i]: the
    step before which request i is added (default all at 0). aborts: {i: step} aborts request i before
    that step. configure(states): adjust the RequestStates after adding (e.g. eos ids).
    → (engine, states in prompt order, {i: [Snapshot…]})."""
    n = len(prompts)
    plist = params if isinstance(params, list) else [params] * n
    arrivals = arrivals or [0] * n
    aborts = aborts or {}
    if engine is None:
        engine = RecordingEngine.build(
            model,
            tokenizer,
            drafter=drafter,
            tree=tree,
            verifier=verifier,
            max_num_seqs=max_num_seqs or n,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            max_model_len=None,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            prefill_first=prefill_first,
        )
    engine.snapshots = {}
    ids = [f"r{i}" for i in range(n)]
    states = [None] * n
    step = 0
    added = 0
    finished = set()
    while len(finished) < n:
        for i in range(n):
            if arrivals[i] == step:
                engine.add_request(prompts[i], plist[i], request_id=ids[i])
                states[i] = engine._requests[ids[i]].state
                added += 1
                if configure is not None and added == n:
                    configure(states)
        for i, at in aborts.items():
            if at == step and ids[i] not in finished:
                engine.abort(ids[i])
        for d in engine.step():
            if d.finish_reason is not None:
                finished.add(d.request_id)
        if on_step is not None:
            on_step(engine, states)
        step += 1
        assert step < 10_000, "the engine does not finish"
    snaps = {i: engine.snapshots.get(ids[i], []) for i in range(n)}
    return engine, states, snaps


@torch.inference_mode()
def prefill_kv(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [layers, Hkv, len, D] of a fresh prefill of `tokens` (a dense one-row cache)."""
    cache = model.new_cache(1, len(tokens))
    prefill_row(model, cache.row(0), tokens, 0, len(tokens))
    return cache.k[:, 0], cache.v[:, 0]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def repetitive_prompts(n: int, seed: int, copies=(2, 5), tail=(0, 6)) -> list[list[int]]:
    """Prompts that repeat a random phrase of 3-6 tokens (copies: a randrange, so draftless drafters find
    matches) and end in a random tail (tail: a randrange of its length)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 7))]
        prompts.append(phrase * rng.randrange(*copies) + [rng.randrange(3, 300) for _ in range(rng.randrange(*tail))])
    return prompts
