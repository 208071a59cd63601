"""The reference backend: every forward through the model's plain PyTorch layers (float weights on the CPU, and
`ExecutionConfig(kernels="off")` anywhere). The other backends fall back to it for the shapes their paths skip."""

from __future__ import annotations

import torch

from redwood.config import ExecutionConfig


class ReferenceBackend:
    name = "reference"

    def __init__(self, execution: ExecutionConfig):
        self.execution = execution

    def prepare(self, model) -> None:
        """Transform the model's weights for this backend (once, at selection): nothing here."""

    def whole_forward(self, model, input_ids, positions, cache, new_mask, logits_at, pending, view, observer):
        """The whole forward as one call where this backend has one for the shape (logits), else None."""
        return None

    def run(self, model, x: torch.Tensor, cos, sin, cache, dest, meta, logits_at) -> torch.Tensor:
        """The decoder layers, final norm and head over x [B, T, H] → logits [B, T or K, V] float32."""
        for layer in model.layers:
            x = layer(x, cos, sin, cache, dest, meta)  # [B, T, H]
        return model.logits(gather(x, logits_at)).float()


def gather(x: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, H] at logits_at [B, K] → [B, K, H] (x itself when None)."""
    if logits_at is None:
        return x
    return torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
