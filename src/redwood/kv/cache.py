"""The KV cache: fixed-size pages, a page table per row, and per-row lengths.

Layout: k, v: [num_layers, P, Hkv, page_size, head_dim] — P physical pages. `block_table` [B, W] names
the pages of each row: row b's logical slot s (slot == the token's position) lives in page
block_table[b, s // page_size] at offset s % page_size. Everything above this module speaks logical
slots: lengths, the slots a forward writes, the draft KV policies' views; the attention paths (the
reference gather here, the Triton kernel) translate through the table.

Two ways to build one:
- dense (`KVCache(config, B, capacity, ...)`): one page of `capacity` slots per row, table = row → page b.
  What offline tools (profiling, acceptance measurement) use: no allocator involved.
- paged (`KVCache.paged(...)`): `num_pages` pages shared by all rows through a `redwood.kv.blocks.BlockPool`
  (the Engine fills the table as requests grow). One extra physical page, the *trash page*, backs every
  table entry no request owns: the forwards of an idle slot (or a row's scratch writes past its pages)
  land there and never in another request's page.

Row b holds its committed tokens in slots [0, lengths[b]); a forward over T new tokens writes them at slots
lengths[b] + t (t < T) without moving `lengths` — the caller then `commit`s how many of them each row keeps
(all of them for autoregressive decoding, the accepted prefix for speculation). Slots past `lengths` are
scratch and never read as context.

`live` [B] is 1 while a row generates and 0 otherwise (a finished row, an idle slot, a slot whose request is
still prefilling): such a row's forwards attend to none of its context (their outputs are discarded), so it
costs no KV reads.

`rows(n)` is the cache of the first n rows: the same pages, views of the first n rows of the table, lengths
and live (so commits through it land in this cache) — what a step over a batch-size bucket runs on.
"""

from __future__ import annotations

import torch

from redwood.config import ModelConfig
from redwood.errors import ContextLengthError


class KVCache:
    def __init__(
        self, config: ModelConfig, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ):
        """A dense cache: one page of `capacity` slots per row."""
        shape = (config.num_layers, batch_size, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_table = torch.arange(batch_size, dtype=torch.int32, device=device)[:, None]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.live = torch.ones(batch_size, dtype=torch.long, device=device)  # 0: reads no context
        self.dense = True  # block_table[b, 0] == b: the reference path slices instead of gathering
        self.trash_page: int | None = None
        self.length_bound: int | None = None  # see `slots`

    @classmethod
    def paged(
        cls,
        config: ModelConfig,
        batch_size: int,
        num_pages: int,
        page_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "KVCache":
        """`num_pages` pages of `page_size` slots (plus the trash page) for `batch_size` rows of at most
        `max_len` slots each; every table entry starts on the trash page and every row live 0."""
        self = cls.__new__(cls)
        shape = (config.num_layers, num_pages + 1, config.num_kv_heads, page_size, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        width = -(-max_len // page_size)
        self.trash_page = num_pages
        self.block_table = torch.full((batch_size, width), num_pages, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.live = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.dense = False
        self.length_bound = None
        return self

    def rows(self, n: int) -> "KVCache":
        """The cache of rows [0, n): shared pages, views of the table / lengths / live."""
        if n == self.batch_size:
            return self
        sub = KVCache.__new__(KVCache)
        sub.__dict__.update(self.__dict__)
        sub.block_table, sub.lengths, sub.live = self.block_table[:n], self.lengths[:n], self.live[:n]
        sub.length_bound = None  # (a bound is its holder's alone: commits through another view would not move it)
        return sub

    def row(self, b: int) -> "KVCache":
        """The cache of row b alone (a prefill's): shared pages, views of row b's table and length."""
        sub = KVCache.__new__(KVCache)
        sub.__dict__.update(self.__dict__)
        # live: its own 1 — a prefilling row is not live in the batch (it does not decode yet), but its
        # prefill attends to its context
        sub.block_table, sub.lengths = self.block_table[b : b + 1], self.lengths[b : b + 1]
        sub.live = torch.ones(1, dtype=torch.long, device=self.lengths.device)
        sub.dense = False  # row b's page is page b, not page 0
        sub.length_bound = None
        return sub

    def select(self, rows: list[int]) -> "KVCache":
        """The cache of these rows (a batched prefill's): shared pages, a copy of their table rows and
        lengths (the caller writes the lengths back), live 1 (their forwards attend to their context)."""
        idx = torch.tensor(rows, device=self.lengths.device)
        sub = KVCache.__new__(KVCache)
        sub.__dict__.update(self.__dict__)
        sub.block_table, sub.lengths = self.block_table[idx], self.lengths[idx]
        sub.live = torch.ones(len(rows), dtype=torch.long, device=self.lengths.device)
        sub.dense = False
        sub.length_bound = None
        return sub

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def capacity(self) -> int:
        """Logical slots a row can hold."""
        return self.block_table.shape[1] * self.page_size

    def slots(self, num_new: int, offset: int = 0) -> torch.Tensor:
        """[B, T] cache slots for T new tokens placed after `offset` pending (uncommitted) ones.

        Checked against the capacity: through `length_bound` when the caller set one (a host-side bound on every
        row's length: a prefill knows its chunks' starts), else by reading the lengths back — a host sync that
        drains the device's queue before the forward's launches (no overlap of host work with a prefill)."""
        idx = self.lengths[:, None] + offset + torch.arange(num_new, device=self.lengths.device)
        if idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return idx  # no host sync inside a CUDA graph; the engine sized the cache for every step
        top = self.length_bound + offset + num_new - 1 if self.length_bound is not None else int(idx.max())
        if top >= self.capacity:
            raise ContextLengthError(f"KV cache full: {top + 1} tokens needed, capacity {self.capacity}")
        return idx

    def physical(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical slots [B, ...] of each row → (page, offset) of the same shape (long). Slots past a
        row's table go to the trash page (a dense cache: offsets past its page, which no writer stores)."""
        B = slots.shape[0]
        if self.dense:
            pages = self.block_table[:, :1].long().reshape(B, *([1] * (slots.dim() - 1)))
            return pages.expand(slots.shape), slots
        ps, width = self.page_size, self.block_table.shape[1]
        raw = slots // ps
        idx = raw.clamp(max=width - 1)
        pages = self.block_table.gather(1, idx.reshape(B, -1)).reshape(slots.shape).long()
        if self.trash_page is None:  # (a row of a dense cache: past its page = past its capacity)
            return pages, slots - idx * ps
        return torch.where(raw < width, pages, self.trash_page), slots % ps

    def write(self, layer: int, dest: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values at dest = physical(slots [B, T]); k, v: [B, Hkv, T, D]."""
        pages, offsets = dest
        # Advanced indices (pages, offsets) around a slice put [B, T] first: values are [B, T, Hkv, D].
        self.k[layer][pages, :, offsets] = k.transpose(1, 2)
        self.v[layer][pages, :, offsets] = v.transpose(1, 2)

    def context(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of slots [0, num_slots) of every row: [B, Hkv, num_slots, D]
        (a view for a dense cache, a gather of the pages otherwise)."""
        k, v = self.k[layer], self.v[layer]
        B = self.batch_size
        if self.dense:
            return k[:B, :, :num_slots], v[:B, :, :num_slots]
        n = -(-num_slots // self.page_size)
        if not k.is_cuda:  # the pages as host ints: views of one page, else one copy of the row's pages
            return self._context_cpu(k, n, num_slots), self._context_cpu(v, n, num_slots)
        pages = self.block_table[:, :n].long()  # [B, n]

        def gather(buf: torch.Tensor) -> torch.Tensor:
            g = buf[pages]  # [B, n, Hkv, ps, D]
            return g.transpose(1, 2).reshape(B, g.shape[2], n * self.page_size, g.shape[4])[:, :, :num_slots]

        return gather(k), gather(v)

    def _context_cpu(self, buf: torch.Tensor, n: int, num_slots: int) -> torch.Tensor:
        """context() of one layer's buffer [pages, Hkv, ps, D] on the CPU: the first n pages of every row
        concatenated along the slots ([B, Hkv, num_slots, D], a view of the page when B = n = 1). The same
        values as indexing the buffer by the page table (one cat of page views: faster than the index +
        transposing reshape; docs/perf/cpu.md, session 14)."""
        B, (_, H, ps, D) = self.batch_size, buf.shape
        pages = self.block_table[:, :n].tolist()
        if B == 1 and n == 1:
            return buf[pages[0][0]][None, :, :num_slots]
        g = torch.cat([buf[p] for row in pages for p in row], dim=1)  # [Hkv, B n ps, D]
        return g.view(H, B, n * ps, D).transpose(0, 1)[:, :, :num_slots]

    def gather(self, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of logical slots idx [B, H', C] (H' = 1: the same slots for every KV head, or
        Hkv) → [B, Hkv, C, D] each."""
        pages, offsets = self.physical(idx)
        k, v = self.k[layer], self.v[layer]
        if idx.shape[1] == 1:  # [B, C] per row → values [B, C, Hkv, D]
            return (k[pages[:, 0], :, offsets[:, 0]].transpose(1, 2), v[pages[:, 0], :, offsets[:, 0]].transpose(1, 2))
        heads = torch.arange(k.shape[1], device=idx.device)[None, :, None]
        return k[pages, heads, offsets], v[pages, heads, offsets]

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
        base = self.lengths[:, None]
        sp, so = self.physical(base + src)
        dp, do = self.physical(base + ar)
        for buf in (self.k, self.v):
            # [B, A, L, Hkv, D] gathered first (a copy), then written: overlapping moves are safe.
            buf[:, dp, :, do] = buf[:, sp, :, so]

    def commit(self, num_kept: torch.Tensor | int) -> None:
        """Advance each row's length by the number of new tokens it keeps ([B] tensor or int)."""
        self.lengths += num_kept
        if self.length_bound is not None:  # (an int moves every row alike; a tensor's largest stays unread)
            self.length_bound = self.length_bound + num_kept if isinstance(num_kept, int) else None
