"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama/Qwen2/Mistral).

Each head's dimensions are split in two halves (x1, x2); position p rotates the pair (x1[i], x2[i]) by the
angle p * inv_freq[i]. Rope scaling only changes inv_freq, so positions can be any integers (compressed
caches keep the true positions of the keys they retain).
"""

from __future__ import annotations

import math

import torch

from redwood.config import ModelConfig


def inverse_frequencies(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32, after rope scaling.

    `rope_freqs` (from a GGUF file) holds per-frequency divisors that llama.cpp bakes in for llama3
    scaling; when given it replaces the analytic rule.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_freqs is not None:
        return inv_freq / rope_freqs.float().reshape(-1)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept; the band between
        # the two wavelength thresholds interpolates linearly in (context / wavelength).
        old_ctx = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smooth = smooth.clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for arbitrary integer positions; shape [B, T, head_dim]."""

    def __init__(self, config: ModelConfig, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config, rope_freqs), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] int64 → angles [B, T, D/2] in float32 (precision matters for large positions)
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] → rotated x of the same shape."""
    return rotate(x, cos[:, None], sin[:, None])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin for cos/sin broadcastable to x (any layout whose last dim is D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))
