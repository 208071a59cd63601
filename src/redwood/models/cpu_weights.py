"""Weight formats for CPU projections: the weights stay packed (int8 / int4 / bfloat16) and each matmul
runs through PyTorch's own CPU kernels instead of a float32 sgemm over dequantized weights.

Why: a CPU decode step is bound by the bytes it reads (float32: 4 bytes a parameter), and the registry's
GGUF files hold 4–6-bit weights. These ops take bfloat16 activations (their float32 paths measured 10–20×
slower), so a packed projection casts its input to bfloat16 and its output back to the model dtype; the
residual stream, norms, attention and the KV cache keep the model dtype.

- "int8": symmetric per-output-row int8, `aten._weight_int8pack_mm` (w8 [N, K] int8, scales [N]).
- "int4": asymmetric int4 in groups of INT4_GROUP inputs (min/max per group: scale = (max − min) / 15,
  w ≈ (q − 8) · scale + zero), packed by `aten._convert_weight_to_int4pack_for_cpu` and multiplied by
  `aten._weight_int4pack_mm_for_cpu` (what gpt-fast / torchao use on the CPU). 32 matches the Q4_K
  sub-block, so a Q4_K tensor's grid is kept whenever a group spans its 16 levels.
- "bfloat16": the weight cast to bfloat16, `F.linear` (oneDNN; on AMX CPUs about flat in the number of
  rows from 2 to 16; one row is padded to two, see PackedLinear.forward).
- "float32": the model as loaded (no change).

Every format computes each row of a multi-row forward like a one-row forward of the same weights, so a
verify over T tokens scores what T decode steps would (greedy speculation == greedy AR for each format);
int8 forwards of INT8_GEMM_ROWS rows or more (prefill chunks) take another kernel, within bfloat16
rounding of the same products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32
_ACT = torch.bfloat16  # the activation dtype the packed CPU kernels are fast in
# int8 forwards of this many rows or more (prefill chunks) convert the weight to bfloat16 and take oneDNN's
# gemm: the int8 kernel's time grows with the rows (17920×1536 at 128 rows: 428 ms against 73 ms to convert
# + 46 ms to multiply; at 64 rows 83 ms against 132). Decode, verify and tree steps stay below it.
INT8_GEMM_ROWS = 128


class PackedLinear(nn.Module):
    """A projection y = x Wᵀ + b whose weight is held in a CPU weight format. x: [..., K] → [..., N] in x's
    dtype. The bias stays float32 and is added after the cast back."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        super().__init__()
        w = weight.detach().float()  # [N, K]
        self.kind, self.out_features, self.in_features = kind, w.shape[0], w.shape[1]
        # Buffers (not parameters, not in the state dict): they follow deepcopy / .to and count in nbytes.
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        if kind == "int8":
            # The kernel reads a bfloat16 scale: quantize against that one, rounded up (×(1 + 2⁻⁸) before
            # rounding to nearest) so ±amax stays within ±127 steps.
            scale = (w.abs().amax(1) / 127 * (1 + 2 ** -8)).clamp_min(1e-12).to(_ACT)  # [N]
            self.register_buffer("w8", torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8),
                                 persistent=False)
            self.register_buffer("scale", scale, persistent=False)
        elif kind == "int4":
            packed, scale_zero = quantize_int4(w, INT4_GROUP)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scale_zero", scale_zero, persistent=False)
        elif kind == "bfloat16":
            self.register_buffer("w16", w.to(_ACT), persistent=False)
        else:
            raise ValueError(f"no packed CPU format {kind!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(_ACT)  # [M, K]
        if self.kind == "int8" and x2.shape[0] >= INT8_GEMM_ROWS:  # prefill: int8 values are exact in bfloat16
            y = F.linear(x2, self.w8.to(_ACT)) * self.scale
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.w8, self.scale)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scale_zero)
        elif x2.shape[0] == 1:  # oneDNN's one-row bfloat16 path is a slow gemv; two rows take the AMX gemm
            y = F.linear(x2.repeat(2, 1), self.w16)[:1]
        else:
            y = F.linear(x2, self.w16)
        y = y.to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this projection multiplies by, as float32 [N, K] (tests compare against it)."""
        if self.kind == "int8":
            return self.w8.float() * self.scale.float()[:, None]
        if self.kind == "int4":
            eye = torch.eye(self.in_features, dtype=_ACT)  # x = I reads Wᵀ back out of the kernel exactly
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, self.scale_zero).float().T
        return self.w16.float()

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: the packed weight, its scales (and zeros) and the bias."""
        return sum(b.nbytes for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.in_features} → {self.out_features}, {self.kind}, bias={self.bias is not None}"


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (packed uint8 weight for `_weight_int4pack_mm_for_cpu`, scales and zeros
    [K / group, N, 2] bfloat16). Per group of `group` inputs: scale = (max − min) / 15, zero = min + 8 ·
    scale, q = round((w − min) / scale) ∈ [0, 15], so w ≈ (q − 8) · scale + zero."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K / group]
    # The kernel sees a bfloat16 scale and zero: quantize against those (the scale rounded up, as for int8).
    scale_b = ((hi - lo) / 15 * (1 + 2 ** -8)).clamp_min(1e-12).to(_ACT)
    zero_b = (lo + 8 * scale_b.float()).to(_ACT)
    q = torch.round((g - zero_b.float()[..., None]) / scale_b.float()[..., None] + 8).clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), 1)
    scale_zero = torch.stack([scale_b, zero_b], -1).transpose(0, 1).contiguous()  # [K / group, N, 2]
    return packed, scale_zero


def check_packable(weight: torch.Tensor, kind: str) -> str | None:
    """Why a weight [N, K] cannot take `kind` (None when it can). int4: the packing needs N % 16 == 0 and
    whole groups along K. int8: torch 2.13's kernel needs K % 16 == 0 (measured: K = 8, 24, 1000 give
    wrong products, K = 5 crashes; every multiple of 16 tried matched)."""
    N, K = weight.shape
    if kind == "int4" and (N % 16 or K % INT4_GROUP):
        return f"int4 needs out_features % 16 == 0 and in_features % {INT4_GROUP} == 0; this projection is {N}×{K}"
    if kind == "int8" and K % 16:
        return f"int8 needs in_features % 16 == 0; this projection is {N}×{K}"
    return None


WEIGHT_CHOICES = ("auto",) + WEIGHT_FORMATS
# "auto" on the CPU for a GGUF file (its float32 tensors are dequantized 4–8-bit data): the fastest format
# at float32's perplexity on this project's 2-core machine (benchmarks/NOTES.md, session 11).
GGUF_DEFAULT = "int8"


def check_weights(weights: str, device: torch.device, offload: bool = False) -> None:
    """A ConfigError for an unknown weights value, or a CPU format asked for a model that runs on CUDA."""
    from redwood.errors import ConfigError

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    if weights not in ("auto", "float32") and (device.type != "cpu" or offload):
        raise ConfigError(f"weights={weights!r} is a CPU format; on CUDA the model runs in its dtype "
                          f"(--dtype bfloat16; a draft model can use --draft-quant int8)")


def resolve_weights(weights: str, device: torch.device, path) -> str:
    """The format a model loaded from `path` onto `device` gets: "auto" → GGUF_DEFAULT for a .gguf file
    on the CPU, else float32 (a float checkpoint stays exact; CUDA keeps its own path)."""
    check_weights(weights, device)
    if weights != "auto":
        return weights
    return GGUF_DEFAULT if device.type == "cpu" and str(path).endswith(".gguf") else "float32"
