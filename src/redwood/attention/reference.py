"""Reference attention over a KV cache: PyTorch SDPA with an explicit boolean mask (CPU and tests).

One call serves decode (T = 1), prefill and chain verification (T new tokens, causal among themselves),
tree verification (an ancestor mask among the new tokens), and drafting over a compressed view.

Cache slots of row b, with L = lengths[b] committed tokens:
    [0, L)             context — every query sees it (or, through a `ContextView`, a subset of it);
    [L, L + P)         `pending` tokens written by earlier forwards of this step (draft tokens);
    [L + P, L + P + T) the T new tokens of this forward.
`new_mask` [T, P + T] says which pending/new tokens each new token sees; None means all pending
tokens and causal among the new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# A context view: layer → (slot indices [B, H', C], valid [B, H', C]), H' = 1 (shared by all KV heads)
# or Hkv (per KV head). Compressed draft caches (StreamingLLM, SnapKV) read the context through one.
ContextView = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class SpanView:
    """A context view of two slot ranges (StreamingLLM's): the first `sinks` slots and the last `window`
    committed ones of each row, lengths [B] the committed lengths it was taken at. Called like any
    ContextView (→ idx, valid [B, 1, sinks + window], shared by every KV head and layer, built on the first
    call of a forward); the Triton decode kernel reads the two ranges as contiguous tiles instead of
    gathering through the indices (triton_decode's ctx_span), which it then never builds."""

    lengths: torch.Tensor
    sinks: int
    window: int
    _shared: tuple | None = field(default=None, repr=False)

    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """idx, valid: [B, sinks + window] — the sink slots, then the last `window` committed slots."""
        dev = self.lengths.device
        B = self.lengths.shape[0]
        sink = torch.arange(self.sinks, device=dev)[None].expand(B, -1)
        recent = self.lengths[:, None] - self.window + torch.arange(self.window, device=dev)
        idx = torch.cat([sink, recent], dim=1)
        # A recent slot below `sinks` is already a sink (short context); slots < 0 don't exist.
        valid = torch.cat([sink < self.lengths[:, None], recent >= self.sinks], dim=1)
        return idx.clamp(min=0), valid

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._shared is None:
            idx, valid = self.indices()
            self._shared = idx[:, None], valid[:, None]
        return self._shared


# Called by every layer with (layer, q [B, Hq, T, D], k [B, Hkv, S, D], mask) before attention.
Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one forward; built once per forward.

    lengths: [B] committed tokens per row. pending: P. num_new: T.
    kv_len: cache slots a full read covers (max over rows of L + P + T); None → computed on first use
    (a host sync — the Triton path never needs it, so CUDA-graph captured steps never compute it).
    q_positions: [B, T] rotary positions of the new tokens (sliding windows compare against them).
    view: None → the full context; else a ContextView selecting part of it.
    live: [B] 0/1 or None; rows with 0 (finished) attend to none of their context, only to the
    pending + new tokens (their outputs are discarded; the Triton kernel then reads none of their KV).
    """

    lengths: torch.Tensor
    num_new: int
    kv_len: int | None = None
    pending: int = 0
    new_mask: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    sliding_window: int | None = None
    view: ContextView | None = None
    observer: Observer | None = None
    live: torch.Tensor | None = None
    # "reference" (SDPA over a dense mask), "triton" (attention.triton_decode: ≤ 256 new tokens) or
    # "triton_prefill" (attention.triton_prefill: long plain prefill forwards on CUDA; ExecutionConfig(prefill_kernel=False) turns it off)
    backend: str = "reference"
    _full_mask: torch.Tensor | None = None
    _packed_mask: torch.Tensor | None = None
    _query_keys: tuple | None = None  # (mask, shape, query_keys(mask, shape)): the by-query plan, for all layers

    def packed_new_mask(self) -> torch.Tensor | None:
        """new_mask as the Triton kernel reads it (triton_decode.pack_new_mask), packed once per forward
        for all layers."""
        if self.new_mask is None:
            return None
        if self._packed_mask is None:
            from redwood.attention.triton_decode import pack_new_mask

            self._packed_mask = pack_new_mask(self.new_mask)
        return self._packed_mask

    def read_len(self) -> int:
        """kv_len, computed from the lengths when not given."""
        if self.kv_len is None:
            self.kv_len = int(self.lengths.max()) + self.pending + self.num_new
        return self.kv_len

    def new_token_mask(self) -> torch.Tensor:
        """[B, T, P + T] bool: which pending/new tokens each new token sees."""
        T, P = self.num_new, self.pending
        B = self.lengths.shape[0]
        if self.new_mask is None:
            j = torch.arange(P + T, device=self.lengths.device)
            m = j[None, :] <= (P + torch.arange(T, device=self.lengths.device))[:, None]
        else:
            m = self.new_mask
        return (m if m.dim() == 3 else m[None]).expand(B, T, P + T)

    def full_mask(self) -> torch.Tensor:
        """[B, 1, T, kv_len] mask over cache slots [0, kv_len), cached across layers."""
        if self._full_mask is None:
            dev = self.lengths.device
            T, W = self.num_new, self.pending + self.num_new
            slot = torch.arange(self.read_len(), device=dev)
            rel = slot[None, :] - self.lengths[:, None]  # [B, S] index among pending+new (<0: context)
            gather_idx = rel.clamp(0, W - 1)[:, None, :].expand(-1, T, -1)
            recent_ok = torch.gather(self.new_token_mask(), 2, gather_idx) & ((rel >= 0) & (rel < W))[:, None, :]
            context = rel < 0
            if self.live is not None:
                context = context & (self.live[:, None] > 0)
            allowed = context[:, None, :] | recent_ok  # [B, T, S]
            self._full_mask = self._apply_window(allowed, slot[None, None, :])[:, None]
        return self._full_mask

    def _apply_window(self, allowed: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        # Slot index == rotary position in redwood's caches (keys keep their true positions).
        if self.sliding_window is None or self.q_positions is None:
            return allowed
        q = self.q_positions[:, :, None] if allowed.dim() == 3 else self.q_positions[:, None, :, None]
        return allowed & (q - key_positions < self.sliding_window)


def read_kv(cache, layer: int, meta: AttentionMetadata):
    """Keys, values and mask one layer attends over, in logical slot order.

    cache: a `redwood.kv.cache.KVCache` (read through its page table). Returns k, v [B, Hkv, S, D] and a
    mask broadcastable to [B, Hkv or 1, T, S].
    """
    if meta.view is None:
        S = meta.read_len()
        k, v = cache.context(layer, S)
        return k, v, meta.full_mask()
    ctx_idx, ctx_valid = meta.view(layer)  # [B, H', C]
    B = ctx_idx.shape[0]
    W = meta.pending + meta.num_new
    recent = meta.lengths[:, None] + torch.arange(W, device=ctx_idx.device)  # [B, W]
    H = ctx_idx.shape[1]
    idx = torch.cat([ctx_idx, recent[:, None, :].expand(B, H, W)], dim=2)  # [B, H', C + W]
    k, v = cache.gather(layer, idx)
    T = meta.num_new
    if meta.live is not None:
        ctx_valid = ctx_valid & (meta.live[:, None, None] > 0)
    ctx_mask = ctx_valid[:, :, None, :].expand(B, H, T, ctx_idx.shape[2])
    new_mask = meta.new_token_mask()[:, None].expand(B, H, T, W)
    mask = torch.cat([ctx_mask, new_mask], dim=3)  # [B, H', T, C + W]
    mask = meta._apply_window(mask, idx[:, :, None, :])
    return k, v, mask


# CPU forwards of at most this many new tokens per row (decode, chain and tree verify — γ ≤ 64 — and short
# prefills) attend one query at a time (`_attention_by_query`); longer ones (prefill chunks) in one call.
BY_QUERY_MAX_NEW = 80


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, meta: AttentionMetadata | None = None
) -> torch.Tensor:
    """q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask [B, 1 or Hkv, T, S] → [B, Hq, T, D]. meta: the
    forward's metadata, where the by-query path keeps its plan for a mask every layer shares."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if q.device.type == "cpu" and q.shape[2] <= BY_QUERY_MAX_NEW and mask.shape[1] == 1:
        shape = (q.shape[0], q.shape[2], k.shape[2])
        if meta is None:
            return _attention_by_query(q, k, v, query_keys(mask, shape))
        if meta._query_keys is None or meta._query_keys[0] is not mask or meta._query_keys[1] != shape:
            meta._query_keys = (mask, shape, query_keys(mask, shape))
        return _attention_by_query(q, k, v, meta._query_keys[2])
    if mask.shape[1] not in (1, Hq):
        mask = mask.repeat_interleave(Hq // Hkv, dim=1)  # per-KV-head mask → per query head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv)


def query_keys(
    mask: torch.Tensor, shape: tuple[int, int, int]
) -> list[list[tuple[int, int, torch.Tensor | None] | None]]:
    """For a mask broadcastable to [B, 1, T, S] (shape = (B, T, S)): per row b and new token t, the keys
    that query sees — (lo, hi, None) when they are the slots [lo, hi), (lo, hi, idx) when they are the
    slots idx (not contiguous), None when none. One pass over the mask (one host read) instead of a
    nonzero and two host reads per query and layer."""
    B, T, S = shape
    allowed = mask.expand(B, 1, T, S)[:, 0]  # [B, T, S]
    a = allowed.to(torch.uint8)
    first = a.argmax(-1)  # (argmax: the first maximal index)
    last = S - 1 - a.flip(-1).argmax(-1)
    count = a.sum(-1, dtype=torch.long)
    plan = []
    for b, row in enumerate(torch.stack([count, first, last], -1).tolist()):
        keys = []
        for t, (n, lo, hi) in enumerate(row):
            if n == 0:
                keys.append(None)
            elif hi + 1 - lo == n:
                keys.append((lo, hi + 1, None))
            else:
                keys.append((lo, hi + 1, allowed[b, t].nonzero().squeeze(1)))
        plan.append(keys)
    return plan


def _attention_by_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> torch.Tensor:
    """`attention` one query (row b, token t) at a time, over exactly the keys it may see, unmasked.

    Why: SDPA's CPU kernel blocks its work by the number of queries, so row t of a T-token call differs in
    the last bits from a one-token call over the same keys. A verify must score its tokens like the AR
    steps it stands for, and on the CPU the packed weights round activations to bfloat16, which turns
    those last bits into other greedy tokens now and then (seen in the README's main job; docs/perf/cpu.md,
    "Figures cited from the source"). Here every query — a decode step's, a chain or tree verify's — is
    the same call: SDPA over the keys its mask allows, in slot order (a slice when they are contiguous,
    as for decode and chains; gathered for trees), which is the same key set, same order, same values as
    the one-token step that would produce that token. (The output does not depend on the slice's strides
    or on masked keys beyond it; checked in tests/attention/test_reference.py.)
    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; plan: `query_keys` of the mask [B, 1, T, S] → [B, Hq, T, D].
    """
    B, Hq, T, D = q.shape
    if B == 1 and T == 1 and plan[0][0] is not None and plan[0][0][2] is None:  # a decode step: one call
        lo, hi, _ = plan[0][0]
        return _one_query(q, k[:, :, lo:hi], v[:, :, lo:hi])
    out = q.new_zeros(B, Hq, T, D)  # a query that sees no key outputs 0 (as the Triton kernel)
    for b in range(B):
        for t in range(T):
            keys = plan[b][t]
            if keys is None:
                continue
            lo, hi, idx = keys
            if idx is None:  # contiguous: views into the read, no copy
                kb, vb = k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi]
            else:
                kb, vb = k[b : b + 1, :, idx], v[b : b + 1, :, idx]
            out[b, :, t] = _one_query(q[b : b + 1, :, t : t + 1], kb, vb)[0, :, 0]
    return out


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one query over all of k / v, unmasked: q [1, Hq, 1, D], k, v [1, Hkv, S, D] →
    [1, Hq, 1, D]; query head h reads KV head h // (Hq / Hkv). Two batched matmuls and a softmax, the query
    heads of a KV head side by side as rows: on the CPU faster than SDPA's kernel for one query, more so
    the longer the context (docs/perf/cpu.md, session 16), which is a decode step's whole attention. Every
    query of `_attention_by_query` takes this same path, so a verify still scores each token like its
    decode step (tests/attention/test_reference.py)."""
    _, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qq = q.reshape(1, Hkv, Hq // Hkv, D)
    scores = torch.matmul(qq, k.transpose(-1, -2)).mul_(D**-0.5)  # [1, Hkv, Hq / Hkv, S]
    return torch.matmul(torch.softmax(scores, dim=-1), v).reshape(1, Hq, 1, D)
