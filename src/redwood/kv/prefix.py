"""Exact prefix reuse: a cache kept across generations remembers the prompts of its last prefill.

Benchmarks run the same prompts through several generations — the autoregressive baseline, then each
speculative configuration — and at batch 64 × 32K tokens each prefill costs tens of seconds. A cache
that a `RunnerPool` keeps with `reuse_prefixes` on carries a `PrefixMemory`; a prefill
(`engine.generate.prefill`) of identical prompts into it then runs no forward: it sets the lengths back
to the prompt lengths, restores each row's last prompt slot and returns the saved last-token logits.

Why that is exact. After a prefill, row b's slots [0, len_b) hold its prompt's KV, and a generation
writes no slot below len_b − 1:
- every forward writes its new tokens at slots ≥ the committed length plus its pending tokens
  (`KVCache.slots`), and tree compaction moves accepted nodes within [length, …) (`KVCache.compact`);
- a generation starts at the prompt lengths and its commits only add to them (the target's cache; a
  finished row's length freezes);
- a standalone drafter rewinds its own cache to the target's committed length − 1 ≥ len_b − 1 before
  each step and re-feeds the newest committed token there, through its draft view: that rewrites slot
  len_b − 1, which the memory therefore saves and puts back.
Whatever else writes a kept cache from slot 0 forgets the memory first: a prefill of other prompts (before
its first forward), `StepRunner.reset`. A runner handed out by the pool must be filled by `prefill`
before any other forward (every engine loop does so).

Bit for bit. The kept slots are the prefill that ran, which is what a fresh prefill computes unless the
two split their forwards differently: a SnapKV-observed prefill cuts the chunks around its observation
window finer (and on CUDA runs them through the reference attention, not the Triton kernel). So a SnapKV
run that finds a plain prefill re-runs it from its first watched chunk — the chunks before it are the
same in both — and computes exactly the fresh observed prefill; a plain run that reuses an observed
prefill may differ from a fresh plain one in the last bits (as any two differently chunked prefills do).
`bench` times the baseline on a prefill of its own, so each of its runs computes what it would without
reuse.

Counts of what prefills did (`PrefillCounts`) let benchmarks report a reused prefill as such.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# Names each prefill that ran (full or partial) in this process: a SnapKV observer that holds its
# selection for prefill `serial` may skip re-observing exactly that prefill.
_SERIALS = itertools.count(1)


def next_serial() -> int:
    return next(_SERIALS)


@dataclass
class PrefillCounts:
    """Prefills into remembering caches, by outcome (the pool's running totals)."""

    computed: int = 0  # ran over the whole prompt
    partial: int = 0  # the cache held the prompts; re-ran only from the first chunk an observer watches
    reused: int = 0  # the cache held the prompts (and the observer its result): no forward

    def snapshot(self) -> tuple[int, int, int]:
        return self.computed, self.partial, self.reused


@dataclass
class PrefixRecord:
    """One prefill a cache holds.

    ids: [B, T] the prompts right-padded with zeros (T = the longest); lengths: each row's prompt length;
    logits: [B, V] float32 of each row's last prompt token; last_k, last_v: [B, L, Hkv, D] each row's
    last prompt slot (slot len_b − 1), the one slot below the prompt a generation may overwrite.
    serial: which prefill (`next_serial`) wrote it.
    """

    ids: torch.Tensor
    lengths: list[int]
    logits: torch.Tensor
    last_k: torch.Tensor
    last_v: torch.Tensor
    serial: int


class PrefixMemory:
    """What a kept cache holds from its last prefill (None: nothing reusable), and the pool's counts."""

    def __init__(self, counts: PrefillCounts):
        self.record: PrefixRecord | None = None
        self.counts = counts

    def holds(self, ids: torch.Tensor, lengths: list[int]) -> bool:
        """Whether the cache holds exactly these prompts (padded ids [B, T] and lengths)."""
        r = self.record
        return (r is not None and r.lengths == lengths and r.ids.shape == ids.shape
                and bool(torch.equal(r.ids, ids)))

    def forget(self) -> None:
        """Something is about to write below the remembered prompts (or already has)."""
        self.record = None

    def remember(self, cache, ids: torch.Tensor, lengths: list[int], logits: torch.Tensor, serial: int,
                 partial: bool) -> None:
        """Record the prefill just run into `cache` (lengths set to the prompt lengths); `partial`: it
        re-ran only the chunks from the first one an observer watched."""
        if partial:
            self.counts.partial += 1
        else:
            self.counts.computed += 1
        rows, last = _last_slots(cache, lengths)
        # Advanced indices (rows, last) around a slice come first: [B, L, Hkv, D].
        self.record = PrefixRecord(ids, list(lengths), logits.clone(), cache.k[:, rows, :, last].clone(),
                                   cache.v[:, rows, :, last].clone(), serial)

    def restore(self, cache) -> torch.Tensor:
        """Put the remembered prefill back: lengths, each row's last prompt slot. Returns its logits."""
        r = self.record
        assert r is not None
        rows, last = _last_slots(cache, r.lengths)
        cache.k[:, rows, :, last] = r.last_k
        cache.v[:, rows, :, last] = r.last_v
        cache.lengths.copy_(torch.tensor(r.lengths, device=cache.lengths.device))
        self.counts.reused += 1
        return r.logits.clone()


def _last_slots(cache, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B], last prompt slot of each row [B] (index tensors on the cache's device)."""
    dev = cache.lengths.device
    return torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev) - 1
