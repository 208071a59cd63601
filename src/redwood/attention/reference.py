"""Reference attention over a KV cache: PyTorch SDPA with an explicit boolean mask (CPU and tests).

One call serves decode (T = 1), prefill and chain verification (T new tokens, causal among themselves)
and tree verification (a [T, T] ancestor mask among the new tokens). The new tokens of row b sit in
cache slots [lengths[b], lengths[b] + T); everything before lengths[b] is context every query sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one forward; built once per forward.

    lengths: [B] committed tokens per row before this forward.
    num_new: T, new tokens per row.
    kv_len: number of cache slots to read (max over rows of lengths + T).
    new_mask: optional [T, T] or [B, T, T] bool, True where new token i may see new token j
              (None → causal).
    q_positions: [B, T] rotary positions of the new tokens (used by sliding windows).
    sliding_window: keys further back than this from the query (in positions) are hidden.
    """

    lengths: torch.Tensor
    num_new: int
    kv_len: int
    new_mask: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    sliding_window: int | None = None
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """Dense [B, 1, T, kv_len] bool mask (True = attend), cached across layers."""
        if self._mask is None:
            self._mask = build_mask(self)
        return self._mask


def build_mask(meta: AttentionMetadata) -> torch.Tensor:
    device = meta.lengths.device
    T, S = meta.num_new, meta.kv_len
    slot = torch.arange(S, device=device)  # [S]
    start = meta.lengths[:, None]  # [B, 1]
    rel = slot[None, :] - start  # [B, S]: index of the slot among the new tokens (<0: context)
    context = rel < 0  # [B, S]
    in_new = (rel >= 0) & (rel < T)
    if meta.new_mask is None:
        new_ok = rel[:, None, :] <= torch.arange(T, device=device)[None, :, None]  # causal [B, T, S]
    else:
        nm = meta.new_mask if meta.new_mask.dim() == 3 else meta.new_mask[None]
        nm = nm.expand(meta.lengths.shape[0], T, T)
        gather_idx = rel.clamp(0, T - 1)[:, None, :].expand(-1, T, -1)  # [B, T, S]
        new_ok = torch.gather(nm, 2, gather_idx)
    allowed = context[:, None, :] | (in_new[:, None, :] & new_ok)  # [B, T, S]
    if meta.sliding_window is not None and meta.q_positions is not None:
        # In a full cache a slot's position is its index.
        too_far = meta.q_positions[:, :, None] - slot[None, None, :] >= meta.sliding_window
        allowed = allowed & ~too_far
    return allowed[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: [B, Hq, T, D]; k, v: [B, Hkv, kv_len, D] (cache slots) → [B, Hq, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask(), enable_gqa=q.shape[1] != k.shape[1])
