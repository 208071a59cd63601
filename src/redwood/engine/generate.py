"""The autoregressive loop over a batch of requests, and the prefill it shares with speculation.

Rows are independent: each has its own prompt length, sampling parameters, random stream and stop
conditions. A finished row stays in the batch (its cache length frozen, `cache.live` 0: its forwards
read none of its KV) until every row is done.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from redwood.config import ModelConfig
from redwood.engine.request import RequestState
from redwood.engine.runner import RunnerPool
from redwood.engine.sampling import Sampler
from redwood.errors import ContextLengthError
from redwood.kv.cache import KVCache
from redwood.kv.policies import PrefillObserver
from redwood.kv.prefix import next_serial
from redwood.models.transformer import Transformer
from redwood.sampling_params import SamplingParams


# Special tokens that end a generation wherever a vocabulary has them (as llama.cpp's end-of-generation
# set): e.g. Qwen instruct files name only <|im_end|> as EOS, yet the model may also emit <|endoftext|>.
END_OF_GENERATION = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>",
                     "<|end|>", "<end_of_turn>")


def eos_token_ids(config: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids: the model config's, the tokenizer's EOS, and its end-of-generation special tokens."""
    ids = set(config.eos_token_ids)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
        for text in END_OF_GENERATION:
            if text in special or text in added:
                tid = tokenizer.convert_tokens_to_ids(text)
                if isinstance(tid, int) and 0 <= tid < config.vocab_size:
                    ids.add(tid)
    return frozenset(ids)


def make_requests(prompts: list[list[int]], params: list[SamplingParams], config: ModelConfig,
                  tokenizer) -> list[RequestState]:
    """RequestStates for token-id prompts, checking each fits the model's context."""
    context = config.max_position_embeddings
    eos = eos_token_ids(config, tokenizer)
    requests = []
    for i, (ids, p) in enumerate(zip(prompts, params)):
        if not ids:
            raise ContextLengthError(f"prompt {i} is empty; give at least one token")
        if len(ids) >= context:
            raise ContextLengthError(
                f"prompt {i} has {len(ids)} tokens but the model's context is {context} tokens "
                f"(at most {context - 1} prompt tokens leave room to generate)"
            )
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise ContextLengthError(f"prompt {i} has token ids outside the vocabulary [0, {config.vocab_size}): {bad[:5]}")
        r = RequestState(prompt_ids=list(ids), params=p, tokenizer=tokenizer, eos_ids=eos,
                         max_new_tokens=min(p.max_new_tokens, context - len(ids)))
        r.stats.prompt_tokens = len(ids)
        requests.append(r)
    return requests


def cache_capacity(requests: list[RequestState], extra: int = 0) -> int:
    """Slots needed: the longest prompt + generation (+ `extra` scratch for speculative steps)."""
    return max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + extra


# Prefill attends in chunks of new tokens so that the attention's [B, Hq, chunk, context] work stays
# bounded (about this many score elements) however long and wide the batch is.
PREFILL_SCORE_BUDGET = 1 << 28
MIN_PREFILL_CHUNK = 256


def prefill_chunk(batch: int, heads: int, total: int) -> int:
    """Tokens per prefill forward for `batch` rows of `total` tokens (a multiple of 256, or all)."""
    chunk = PREFILL_SCORE_BUDGET // max(1, batch * heads * total)
    chunk = max(MIN_PREFILL_CHUNK, chunk // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK)
    return min(chunk, total)


def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]],
            observer: PrefillObserver | None = None) -> torch.Tensor:
    """Run all prompts (right-padded to the longest) into the cache from slot 0; commit them.

    Long prompts go through in chunks (`prefill_chunk`), each attending to the chunks before it.
    observer: watches the queries it asks for (`PrefillObserver.observes`; a SnapKV policy's observation
    window) — their forwards attend through the reference path (in pieces that bound its score work,
    `_forwards`), all others through the fast one.
    A cache that remembers its prefills (`cache.prefix`, see `redwood.kv.prefix`) and already holds
    exactly these prompts runs no forward (or, when the observer has not seen that prefill, only the
    chunks from the first one it watches).
    Returns the logits of each row's last prompt token: [B, V] float32. Padding slots lie past each
    row's length, so they are never read and get overwritten by the row's next tokens.
    """
    device = model.device
    B = len(prompts)
    if B != cache.batch_size:
        raise ValueError(f"prefill: {B} prompts for a cache of {cache.batch_size} rows")
    cache.live.fill_(1)  # every row generates until it finishes
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ContextLengthError(f"prefill: prompt {lengths.index(0)} is empty")
    T = max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    chunk = prefill_chunk(B, model.config.num_heads, T)
    memory = cache.prefix
    first = 0  # the first chunk to run
    if memory is not None and memory.holds(ids, lengths):
        if observer is None or observer.resume(memory.record.serial):
            return memory.restore(cache)
        first = next((s for s in range(0, T, chunk) if observer.observes(s, min(s + chunk, T))), 0)
        first = min(first, (min(lengths) - 1) // chunk * chunk)  # every row's last token gets logits
    if memory is not None:
        memory.forget()  # the forwards below overwrite what it remembers
    serial = next_serial()
    logits = _run_chunks(model, cache, ids, torch.tensor(lengths, device=device), first, chunk, observer)
    if observer is not None:
        observer.finish(serial)
    if memory is not None:
        memory.remember(cache, ids, lengths, logits, serial, partial=first > 0)
    return logits


def _run_chunks(model: Transformer, cache: KVCache, ids: torch.Tensor, lens: torch.Tensor, first: int,
                chunk: int, observer: PrefillObserver | None) -> torch.Tensor:
    """Prefill forwards over ids [B, T] from position `first` (a chunk boundary; the cache already
    holds every row's slots below it) in chunks of `chunk`; sets lengths to lens [B]. → last-token
    logits [B, V] (every row's last token lies at or after `first`)."""
    B, T = ids.shape
    cache.lengths.fill_(first)
    last = lens - 1  # [B] index of each row's last prompt token
    logits = None
    for start in range(first, T, chunk):
        stop = min(start + chunk, T)
        for a, b, watched in _forwards(start, stop, observer, B * model.config.num_heads):
            positions = torch.arange(a, b, device=ids.device)[None].expand(B, -1)
            at = (last - a).clamp(0, b - a - 1)
            out = model(ids[:, a:b], positions, cache, logits_at=at[:, None],
                        observer=observer.at(a) if watched else None)[:, 0]
            here = ((last >= a) & (last < b))[:, None]
            logits = out if logits is None else torch.where(here, out, logits)
            cache.commit(b - a)
    cache.lengths.copy_(lens)
    return logits


def _forwards(start: int, stop: int, observer: PrefillObserver | None,
              rows_heads: int) -> list[tuple[int, int, bool]]:
    """The forwards (a, b, observed) that prefill positions [start, stop) of one chunk.

    A chunk the observer does not watch: one forward. A watched chunk: its watched positions go in
    observed forwards of at most PREFILL_SCORE_BUDGET / (B·Hq·stop) tokens — observed forwards attend
    through the reference path, whose [B, Hq, T, stop] scores the budget bounds (the 256-token chunk
    floor does not, at batch 64 × 32K) — and each run of unwatched positions between them in one
    unobserved forward.
    """
    if observer is None or not observer.observes(start, stop):
        return [(start, stop, False)]
    fine = max(1, PREFILL_SCORE_BUDGET // (rows_heads * stop))
    out: list[tuple[int, int, bool]] = []
    for a in range(start, stop, fine):
        b = min(a + fine, stop)
        watched = observer.observes(a, b)
        if not watched and out and not out[-1][2]:
            out[-1] = (out[-1][0], b, False)  # extend the unobserved run
        else:
            out.append((a, b, watched))
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timing on CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def autoregressive(model: Transformer, requests: list[RequestState],
                   pool: RunnerPool | None = None) -> Iterator[list[int]]:
    """Generate for all requests; after each step yields the rows that received a token.

    pool: where the KV cache (and, on CUDA, the captured decode graph) comes from; None → a fresh
    cache, eager forwards.
    """
    device = model.device
    sampler = Sampler([r.params for r in requests], device)
    pool = pool or RunnerPool(use_graphs=False)
    runner = pool.get("target", model, len(requests), cache_capacity(requests))
    cache = runner.cache
    t0 = time.perf_counter()
    logits = prefill(model, cache, [r.prompt_ids for r in requests])
    tokens = sampler.sample(logits)
    token_list = tokens.tolist()
    t1 = time.perf_counter()
    captured_at_t1 = pool.capture_s  # decode times leave out one-time graph captures (the first step's)
    for r in requests:
        r.stats.prefill_s = t1 - t0
    active = cache.live  # 1 per row still generating: what each step commits, and whom attention reads
    while True:
        updated = []
        for b, r in enumerate(requests):
            if not r.finished:
                updated.append(b)
                if r.append(token_list[b]):
                    active[b] = 0
                    r.stats.decode_s = time.perf_counter() - t1 - (pool.capture_s - captured_at_t1)
        yield updated
        if all(r.finished for r in requests):
            return
        # Finished rows keep feeding their last token at a frozen position; nothing of theirs is committed.
        positions = cache.lengths[:, None]
        logits = runner.forward(tokens[:, None], positions)[:, 0]
        cache.commit(active)
        tokens = sampler.sample(logits)
        token_list = tokens.tolist()
