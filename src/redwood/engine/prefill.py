"""Prefill: one chunk of one request's known tokens into its slot of the cache.

The Engine prefills a request in chunks (the scheduler's token budget per step) while other rows decode;
each chunk runs on the one-row cache of the request's slot (`KVCache.row`: the shared pages through that
row's page table) from slot `start` on — what earlier chunks (or the prefix cache) left in slots
[0, start) is its context. Within a chunk the forwards are bounded twice:
- attention work: a forward of T new tokens over S context slots scores T·Hq·S elements (the reference
  path materializes them), kept near PREFILL_SCORE_BUDGET — unless the model's long forwards go through
  the flash prefill kernel (`Transformer.prefill_kernel`, on CUDA unless ExecutionConfig(prefill_kernel=False)), which materializes
  none: then one forward takes the whole chunk;
- an observer (SnapKV's observation window) watches only the forwards that hold window queries; those
  attend through the reference path in pieces small enough for its scores, the others as usual.
"""

from __future__ import annotations

import torch

from redwood.kv.cache import KVCache
from redwood.kv.policies import PrefillObserver
from redwood.models.transformer import Transformer

# About this many attention score elements per prefill forward (T new tokens × Hq heads × S slots).
PREFILL_SCORE_BUDGET = 1 << 28
MIN_PREFILL_CHUNK = 256
# Rows × tokens per prefill forward when the flash prefill kernel attends (no score budget there).
PREFILL_TOKEN_CAP = 1 << 15


def prefill_chunk(batch: int, heads: int, total: int) -> int:
    """Tokens per prefill forward for `batch` rows of `total` tokens (a multiple of 256, or all)."""
    chunk = PREFILL_SCORE_BUDGET // max(1, batch * heads * total)
    chunk = max(MIN_PREFILL_CHUNK, chunk // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK)
    return min(chunk, total)


def _forward_tokens(model: Transformer, batch: int, total: int) -> int:
    """Tokens per unobserved prefill forward of `batch` rows. Where long forwards attend through the
    reference path, prefill_chunk's score budget (it materializes [B, Hq, T, S] scores: at 24K slots a
    1-row forward gets 768 tokens, an 8-row one 256 — which then takes the decode kernel). Where they go
    through the flash prefill kernel (`Transformer.prefill_kernel`), which materializes nothing of size S,
    only PREFILL_TOKEN_CAP rows × tokens per forward (the activations: the MLP's [B·T, 2F] is ~35 KB a
    token for a 1.5B), a multiple of 256 or all — the Engine's chunks (max_num_batched_tokens, 2048 by
    default) fit in one forward."""
    if model.prefill_kernel():
        chunk = max(MIN_PREFILL_CHUNK, PREFILL_TOKEN_CAP // max(1, batch) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK)
        return min(chunk, total)
    return prefill_chunk(batch, model.config.num_heads, total)


def prefill_row(
    model: Transformer,
    cache: KVCache,
    token_ids: list[int],
    start: int,
    stop: int,
    observer: PrefillObserver | None = None,
    want_logits: bool = False,
) -> torch.Tensor | None:
    """Compute the KV of token_ids[start:stop] into the one-row `cache` (its slots [0, start) already
    hold token_ids[:start]) and commit them; → the logits [V] float32 of token stop − 1 when asked.

    observer: watches the forwards holding its queries (`PrefillObserver.observes`); the caller calls its
    `finish` once the whole prefill is done.
    """
    device = model.device
    ids = torch.tensor(token_ids[start:stop], device=device)[None]  # [1, stop − start]
    cache.lengths.fill_(start)
    logits = None
    heads = model.config.num_heads
    a = start
    while a < stop:
        b = min(stop, a + _forward_tokens(model, 1, stop))
        for fa, fb, watched in _forwards(a, b, observer, heads):
            positions = torch.arange(fa, fb, device=device)[None]
            last = want_logits and fb == stop
            out = model(
                ids[:, fa - start : fb - start],
                positions,
                cache,
                logits_at=torch.tensor([[fb - fa - 1]], device=device)
                if last
                else torch.zeros(1, 1, dtype=torch.long, device=device),
                observer=observer.at(fa) if watched else None,
            )
            if last:
                logits = out[0, 0]
            cache.commit(fb - fa)
        a = b
    return logits


def prefill_rows(
    model: Transformer, cache: KVCache, rows: list[int], token_ids: list[list[int]], starts: list[int], stops: list[int]
) -> torch.Tensor:
    """One prefill chunk for each of several rows at once (no observer): row rows[i] computes the KV of
    token_ids[i][starts[i]:stops[i]] (its slots below starts[i] already hold the tokens before) and
    commits them. → logits [len(rows), V] float32 of each row's token stops[i] − 1.

    The chunks are right-padded to the longest: a padding token of row i lands in a scratch slot past
    stops[i] (in the row's own pages or the trash page) and is never read as context; the causal mask
    keeps real tokens from seeing it.
    """
    device = model.device
    B = len(rows)
    n = [b - a for a, b in zip(starts, stops)]
    T = max(n)
    alone = [i for i, a in enumerate(starts) if a + T > cache.capacity]
    if alone and B > 1:
        # Padding row i to the longest chunk would run its scratch slots past the end of its table (a
        # chunk ending near max_model_len beside a longer one): such rows go alone, the rest together.
        rest = [i for i in range(B) if i not in alone]
        logits = [None] * B
        for part in [[i] for i in alone] + ([rest] if rest else []):
            out = prefill_rows(
                model,
                cache,
                [rows[i] for i in part],
                [token_ids[i] for i in part],
                [starts[i] for i in part],
                [stops[i] for i in part],
            )
            for j, i in enumerate(part):
                logits[i] = out[j]
        return torch.stack(logits)
    sub = cache.select(rows)
    ids = torch.zeros(B, T, dtype=torch.long)  # (filled on the host, then one copy)
    for i, (toks, a, b) in enumerate(zip(token_ids, starts, stops)):
        ids[i, : b - a] = torch.tensor(toks[a:b])
    ids = ids.to(device)
    start_t = torch.tensor(starts, device=device)
    last = torch.tensor(n, device=device) - 1  # [B] offset of each row's last chunk token
    # (made before the forwards: a tensor from a host list is a copy that waits for the device's queue — made
    # after them, the call returned only once they were done: `benchmarks/sync_points.py`)
    rows_t, stops_t = torch.tensor(rows, device=device), torch.tensor(stops, device=device)
    sub.lengths.copy_(start_t)
    # Known here: no forward reads the lengths back to check the capacity (a host sync each forward) — the
    # forwards queue on the device and the caller's host work after this call overlaps them.
    sub.length_bound = max(starts)
    logits = None
    step = _forward_tokens(model, B, max(stops))
    for a in range(0, T, step):
        b = min(a + step, T)
        positions = start_t[:, None] + torch.arange(a, b, device=device)
        at = (last - a).clamp(0, b - a - 1)
        out = model(ids[:, a:b], positions, sub, logits_at=at[:, None])[:, 0]
        here = ((last >= a) & (last < b))[:, None]
        logits = out if logits is None else torch.where(here, out, logits)
        sub.commit(b - a)
    cache.lengths[rows_t] = stops_t
    return logits


def _forwards(start: int, stop: int, observer: PrefillObserver | None, rows_heads: int) -> list[tuple[int, int, bool]]:
    """The forwards (a, b, observed) that prefill positions [start, stop).

    Unwatched positions: one forward. Watched ones go in observed forwards of at most
    PREFILL_SCORE_BUDGET / (B·Hq·stop) tokens — observed forwards attend through the reference path,
    whose [B, Hq, T, stop] scores the budget bounds — and each run of unwatched positions between them in
    one unobserved forward.
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


def prefill_batch(
    model: Transformer, cache: KVCache, prompts: list[list[int]], observer: PrefillObserver | None = None
) -> torch.Tensor:
    """Prefill a whole batch of prompts (right-padded to the longest) into a dense cache from slot 0 and
    commit them; → the logits [B, V] float32 of each row's last prompt token. For offline tools
    (profiling, tests) that hold a fixed batch; the Engine prefills one row at a time (`prefill_row`).

    observer: as in `prefill_row`, over the batch (it is finished here). Padding slots lie past each row's
    length, so they are never read and get overwritten by the row's next tokens.
    """
    device = model.device
    B = len(prompts)
    if B != cache.batch_size:
        raise ValueError(f"prefill: {B} prompts for a cache of {cache.batch_size} rows")
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ValueError(f"prefill: prompt {lengths.index(0)} is empty")
    cache.live.fill_(1)
    T = max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    lens = torch.tensor(lengths, device=device)
    last = lens - 1  # [B] index of each row's last prompt token
    chunk = _forward_tokens(model, B, T)
    cache.lengths.zero_()
    logits = None
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        for a, b, watched in _forwards(start, stop, observer, B * model.config.num_heads):
            positions = torch.arange(a, b, device=device)[None].expand(B, -1)
            at = (last - a).clamp(0, b - a - 1)
            out = model(
                ids[:, a:b], positions, cache, logits_at=at[:, None], observer=observer.at(a) if watched else None
            )[:, 0]
            here = ((last >= a) & (last < b))[:, None]
            logits = out if logits is None else torch.where(here, out, logits)
            cache.commit(b - a)
    cache.lengths.copy_(lens)
    if observer is not None:
        observer.finish()
    return logits


@torch.inference_mode()
def fresh_logits(model: Transformer, token_ids: list[int]) -> torch.Tensor:
    """The target's logits after `token_ids` from one fresh forward (batch 1, a cache of its own) → [V] float32:
    what a benchmark asks where a greedy speculative output parts from the autoregressive one
    (`bench.divergence`; through an engine, `Engine.prompt_logits`, which every rank joins under tensor
    parallelism)."""
    cache = model.new_cache(1, len(token_ids) + 1)
    return prefill_batch(model, cache, [list(token_ids)])[0].float()
