"""A preallocated KV cache with per-row lengths.

Layout: k, v: [num_layers, B, Hkv, capacity, head_dim]. Row b holds its committed tokens in slots
[0, lengths[b]); a forward over T new tokens writes them at slots lengths[b] + t (t < T) without moving
`lengths` — the caller then `commit`s how many of them each row keeps (all of them for autoregressive
decoding, the accepted prefix for speculation). Slots past `lengths` are scratch and never read as
context.
Every write (compaction too) lands at or after the committed length, so a row's committed slots change
only after someone lowers `lengths` (a prefill; a standalone drafter's one-token rewind) — which is what
lets a kept cache reuse the prompts it holds (`redwood.kv.prefix`).

`live` [B] is 1 while a row generates and 0 once it has finished: a finished row stays in the batch
until every row is done, and its forwards attend to none of its context (their outputs are discarded),
so the finished rows of a long-context batch stop costing KV reads.
"""

from __future__ import annotations

import torch

from redwood.config import ModelConfig
from redwood.errors import ContextLengthError


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (config.num_layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.live = torch.ones(batch_size, dtype=torch.long, device=device)  # 0: finished (see module doc)
        self.capacity = capacity
        # The prompts of the last prefill, for exact prefix reuse (`redwood.kv.prefix`): a PrefixMemory
        # on caches a RunnerPool keeps with reuse_prefixes on; None (nothing remembered) otherwise.
        self.prefix = None

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def slots(self, num_new: int, offset: int = 0) -> torch.Tensor:
        """[B, T] cache slots for T new tokens placed after `offset` pending (uncommitted) ones."""
        idx = self.lengths[:, None] + offset + torch.arange(num_new, device=self.lengths.device)
        if idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return idx  # no host sync inside a CUDA graph; the engine sized the cache for every step
        if int(idx.max()) >= self.capacity:
            raise ContextLengthError(
                f"KV cache full: {int(idx.max()) + 1} tokens needed, capacity {self.capacity}"
            )
        return idx

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slots: [B, T]; k, v: [B, Hkv, T, D]."""
        rows = torch.arange(self.batch_size, device=slots.device)[:, None]
        # Advanced indices (rows, slots) around a slice put [B, T] first: values are [B, T, Hkv, D].
        self.k[layer][rows, :, slots] = k.transpose(1, 2)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)

    def compact(self, src: torch.Tensor, count: torch.Tensor) -> None:
        """Move accepted tree nodes' KV into place before committing them.

        src: [B, A] offsets (from lengths) of the nodes to keep, in path order, with src[:, i] >= i;
        count: [B] how many of them each row keeps. Row b's entry i moves from slot L + src[b, i] to
        slot L + i (entries past count[b] are left alone). A chain's path is already in place.
        """
        B, A = src.shape
        if A == 0:
            return
        ar = torch.arange(A, device=src.device)
        keep = ar[None, :] < count[:, None]
        src = torch.where(keep, src, ar[None, :])  # rows/entries not kept move onto themselves
        rows = torch.arange(B, device=src.device)[:, None]
        base = self.lengths[:, None]
        for buf in (self.k, self.v):
            # [L, B, A, Hkv, D] gathered first (a copy), then written: overlapping moves are safe.
            buf[:, rows, :, base + ar] = buf[:, rows, :, base + src]

    def commit(self, num_kept: torch.Tensor | int) -> None:
        """Advance each row's length by the number of new tokens it keeps ([B] tensor or int)."""
        self.lengths += num_kept
