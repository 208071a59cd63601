"""Weight formats for CPU projections: the weights stay packed (int8 / int4 / bfloat16) and each matmul
runs through PyTorch's own CPU kernels instead of a float32 sgemm over dequantized weights.

Why: a CPU decode step is bound by the bytes it reads (float32: 4 bytes a parameter), and the registry's
GGUF files hold 4–6-bit weights. These ops take bfloat16 activations (their float32 paths are far slower:
docs/perf/cpu.md, "Figures cited from the source"), so a packed projection casts its input to bfloat16 and its
output back to the model dtype; the residual stream, norms, attention and the KV cache keep the model dtype.

- "int8": symmetric per-output-row int8, `aten._weight_int8pack_mm` (w8 [N, K] int8, scales [N]).
- "int4": asymmetric int4 in groups of INT4_GROUP inputs (min/max per group: scale = (max − min) / 15,
  w ≈ (q − 8) · scale + zero), packed by `aten._convert_weight_to_int4pack_for_cpu` and multiplied by
  `aten._weight_int4pack_mm_for_cpu` (what gpt-fast / torchao use on the CPU). 32 matches the Q4_K
  sub-block, so a Q4_K tensor's grid is kept whenever a group spans its 16 levels.
- "bfloat16": the weight cast to bfloat16, `F.linear` (oneDNN; on AMX CPUs about flat in the number of
  rows from 2 to 16; one row is padded to two, see PackedLinear.forward).
- "w8a8": int8 weights (per output row, as "int8") × int8 ACTIVATIONS: each input row quantized on its
  own (`quantize_rows`: float32 scale = max |x| / 127) and multiplied with integer dot products by fbgemm
  (`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`: VNNI on AVX512-VNNI CPUs). The op's own
  per-TENSOR input quantization is made the identity (integer-valued input, scale 1, zero point 128), its
  int32 sums are exact, and each output row is scaled by its own s afterwards — so rows are independent of
  the other rows (and of the thread count) bit for bit, at any M, prefill included. About bandwidth-bound
  where the weight-only kernels are compute-bound (docs/perf/cpu.md, session 15).
- "q4k": every projection re-quantized to Q4_K super-blocks (4.5 bits a weight; a plain min/max grid per 32
  values, `kquant.quantize_q4k`; in_features padded with zero weights to whole blocks of 256) and multiplied
  by the kquant kernel (int8 activations, below) — for a draft model, whose weights only change the
  acceptance: a 0.5B draft reads ~0.3 GB a token instead of w8a8's ~0.5.
- "float32": the model as loaded (no change).
- "gguf" (a GGUF file only, chosen as it loads): each projection in the kernel format that holds its type in
  the file — 4-bit group types (Q4_K, Q4_0, Q4_1: q · step − offset per 32 values, q ∈ [0, 15]) become
  int4 with the file's own q and a (scale, zero) per group that reproduces its values to bfloat16's
  precision (`int4_scale_zero`: no re-quantization), every type with more bits (Q5_*, Q6_K, Q8_0, F16,
  F32) int8, or bfloat16 where int8's kernel cannot take the shape. A Q4_K_M file thus keeps its own
  quality at about int4's speed.
- "kquant" (a GGUF file only, chosen as it loads): Q4_K, Q6_K, Q8_0 and Q5_0 tensors keep the file's own blocks
  and multiply them by int8 activations (each row quantized per 256 values) with integer dot products
  (redwood.cpu_kernels.kquant: a C++ kernel built on first use for the CPU's ISA — AVX-512 VNNI, AVX-VNNI, AVX2,
  NEON or portable C++, the same bits in each) — the file's bytes per token
  (~4.6 / 6.6 / 8.5 / 5.5 bits a weight), the way llama.cpp runs them; every other type w8a8 (int8 where w8a8 is
  not exact here). Rows are exact at any M as w8a8's.

Every format computes each row of a multi-row forward like a one-row forward of the same weights, so a
verify over T tokens scores what T decode steps would (greedy speculation == greedy AR for each format);
int8 forwards of INT8_GEMM_ROWS tokens per sequence or more and int4 forwards of INT4_GEMM_ROWS or more
(prefill chunks; `prefill_rows`) take another kernel (the weight unpacked to bfloat16, oneDNN's gemm), within bfloat16 rounding of the same
products.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4", "w8a8", "q4k")  # one kernel for every projection
_KQ_KINDS = ("kquant", "q4k")  # the kinds the kquant kernel multiplies (buffer kq, type_name)
FILE_FORMAT = "gguf"  # each projection as its GGUF type allows (module docstring); set as a GGUF file loads
KQUANT = "kquant"  # Q4_K / Q6_K / Q8_0 / Q5_0 blocks as the file holds them × int8 activations, the rest w8a8
FILE_FORMATS = (FILE_FORMAT, KQUANT)  # formats chosen per projection as a GGUF file loads
INT4_GROUP = 32
_ACT = torch.bfloat16  # the activation dtype the packed CPU kernels are fast in
# int8 forwards of this many rows or more (prefill chunks) convert the weight to bfloat16 and take oneDNN's
# gemm: the int8 kernel's time grows with the rows, and from here converting + multiplying is cheaper
# (docs/perf/cpu.md, session 11). Decode, verify and tree steps stay below it.
INT8_GEMM_ROWS = 128
# int4 the same way from this many rows (the weight unpacked from the kernel's layout to bfloat16, in slices
# of INT4_SLICE output rows, then oneDNN's gemm): faster for long prefills and even at 128 rows
# (docs/perf/cpu.md, session 12). Like INT8_GEMM_ROWS it stays above every batch-1 verify (a tree of at
# most 64 drafts: 65 rows), whose rows must equal one-row forwards.
INT4_GEMM_ROWS = 128
INT4_SLICE = 2048


def prefill_rows(x: torch.Tensor) -> int:
    """The size that sends a forward to the gemm path: tokens per sequence for [B, T, K] inputs (a prefill
    chunk has many), all rows for [M, K]. Not B × T: a batch of decode or verify steps (B × (γ + 1) rows,
    however large B is) must stay on the kernel whose rows equal one-row products, or a verify at batch 32
    would score its tokens with another kernel than the AR steps it stands for."""
    return x.shape[-2] if x.dim() >= 3 else x.shape[0]


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
            w8, scale = quantize_int8(w)
            self.register_buffer("w8", w8, persistent=False)
            self.register_buffer("scale", scale, persistent=False)
        elif kind == "int4":
            packed, scale_zero = quantize_int4(w, INT4_GROUP)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scale_zero", scale_zero, persistent=False)
        elif kind == "bfloat16":
            self.register_buffer("w16", w.to(_ACT), persistent=False)
        elif kind == "w8a8":
            w8, scale = quantize_int8(w)
            self._set_w8a8(w8, scale)
        elif kind == "q4k":
            from redwood.cpu_kernels import kquant

            self.type_name = "Q4_K"
            self.register_buffer("kq", kquant.pack(kquant.quantize_q4k(w), "Q4_K"), persistent=False)
        else:
            raise ValueError(f"no packed CPU format {kind!r}")

    @classmethod
    def from_int8(cls, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A w8a8 projection of int8 weights w8 [N, K] with per-row scales [N] as they are (no
        re-quantization): an int8 projection's (w8, scale) taken as w8a8 multiplies by the same weight."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kind, self.out_features, self.in_features = "w8a8", w8.shape[0], w8.shape[1]
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self._set_w8a8(w8, scale)
        return self

    def _set_w8a8(self, w8: torch.Tensor, scale: torch.Tensor) -> None:
        """w8a8's state: the scales [N] (a buffer) and fbgemm's packed weight (a ScriptObject, not a buffer:
        about N × K bytes), made from the int8 values w8 [N, K] on first use (`packed_w8a8`) and the values
        then dropped — so a projection that joins a concatenation is never packed on its own (packing and
        unpacking each member cost half a w8a8 load). `_slice` (whole, start) instead of a packed weight: a
        member of a concatenation, whose product is a slice of the whole's."""
        self.register_buffer("scale", scale, persistent=False)
        self._w8, self._w8a8, self._slice = w8, None, None

    def packed_w8a8(self):
        """w8a8: fbgemm's packed weight, packed now if it was not yet (Transformer.quantize_cpu packs every
        one as the model loads, after its concatenations); a member of a concatenation: the whole's."""
        if self._slice is not None:
            return self._slice[0].packed_w8a8()
        if self._w8a8 is None:
            self._w8a8, self._w8 = pack_w8a8(self._w8, self.scale), None
        return self._w8a8

    @classmethod
    def from_int4_groups(
        cls, q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None = None
    ) -> "PackedLinear":
        """An int4 projection holding a file's 4-bit grid as it is: q uint8 [N, K] in 0..15, step and
        offset float32 [N, K / INT4_GROUP], weight = q · step − offset (`loading.gguf.int4_groups`). The
        (scale, zero) per group is `int4_scale_zero`'s; q is packed unchanged."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        N, K = q.shape
        self.kind, self.out_features, self.in_features = "int4", N, K
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        scale, zero = int4_scale_zero(step, offset)  # [N, K / group] each
        self.register_buffer("packed", _pack_int4(q), persistent=False)
        self.register_buffer(
            "scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous(), persistent=False
        )
        return self

    @classmethod
    def from_kquant(cls, rows: torch.Tensor, type_name: str, bias: torch.Tensor | None = None) -> "PackedLinear":
        """A kquant projection of a Q4_K / Q6_K / Q8_0 / Q5_0 tensor's raw rows (uint8 [N, K / file block · block
        bytes], HF row order), re-laid for the kernel (`kquant.pack`: the same values; Q8_0 / Q5_0 rows padded with
        zero blocks to whole super-blocks of 256)."""
        from redwood.cpu_kernels import kquant

        self = cls.__new__(cls)
        nn.Module.__init__(self)
        N = rows.shape[0]
        K = kquant.file_row_values(type_name, rows.shape[1])
        self.kind, self.out_features, self.in_features, self.type_name = KQUANT, N, K, type_name
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.register_buffer("kq", kquant.pack(rows, type_name), persistent=False)
        return self

    @classmethod
    def concat(cls, linears: list["PackedLinear"]) -> "PackedLinear":
        """One projection whose output is the members' outputs side by side (q | k | v, gate | up): one
        kernel call instead of several. Each output column of the int8 and int4 kernels is computed alone,
        so the product equals the members' products concatenated, bit for bit (tested). The members' weight
        buffers become views of the new one's (no memory is duplicated; an int4 member's scale_zero is then
        a strided view, made contiguous when that member runs by itself). Members must share kind
        (int8 or int4: `can_concat`) and in_features."""
        if not can_concat(linears):
            raise ValueError(
                "concat needs int8 or int4 members of one kind and in_features "
                "(int4: out_features % 64 == 0), all with a bias or none"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        first = linears[0]
        self.kind, self.in_features = first.kind, first.in_features
        self.out_features = sum(m.out_features for m in linears)
        if self.kind in _KQ_KINDS:
            self.type_name = first.type_name
        bias = None if first.bias is None else torch.cat([m.bias for m in linears])
        self.register_buffer("bias", bias, persistent=False)
        if self.kind == "w8a8":  # one packed weight; each member's product becomes a slice of the whole's
            self._set_w8a8(torch.cat([m.int8_weight() for m in linears]), torch.cat([m.scale for m in linears]))
            start = 0
            for m in linears:
                m._w8, m._w8a8, m._slice = None, None, (self, start)
                m.scale = self.scale[start : start + m.out_features]
                if bias is not None:
                    m.bias = bias[start : start + m.out_features]
                start += m.out_features
            return self
        names_dims = {"int8": (("w8", 0), ("scale", 0)), KQUANT: (("kq", 0),), "q4k": (("kq", 0),)}.get(
            self.kind, (("packed", 0), ("scale_zero", 1))
        )
        for name, dim in names_dims:
            whole = torch.cat([getattr(m, name) for m in linears], dim=dim)
            self.register_buffer(name, whole, persistent=False)
            start = 0
            for m in linears:
                n = getattr(m, name).shape[dim]
                setattr(m, name, whole.narrow(dim, start, n))
                start += n
        if bias is not None:
            start = 0
            for m in linears:
                m.bias = bias[start : start + m.out_features]
                start += m.out_features
        return self

    def raw(self, x2: torch.Tensor) -> torch.Tensor:
        """The kernel's product of x2 [M, K] in `act_dtype` (bfloat16; float32 for kquant / q4k; M below the
        gemm paths' rows) → bfloat16 [M, N] (w8a8, kquant, q4k: float32, at any M), without the cast back or
        the bias (below those rows `forward` is raw(x.to(act_dtype)).to(x.dtype) + bias)."""
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x2, self.w8, self.scale)
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self._scale_zero())
        if self.kind in _KQ_KINDS:  # float32 [M, N], as w8a8
            from redwood.cpu_kernels import kquant

            x2 = x2.float()
            if self.kind == "q4k" and self.in_features % kquant.BLOCK:  # (zero weights pad the blocks)
                x2 = F.pad(x2, (0, kquant.padded(self.in_features) - self.in_features))
            return kquant.kquant_linear(x2, self.kq, self.type_name)
        if self.kind == "w8a8":  # float32 [M, N] (not rounded to bfloat16: the callers cast or add in float32)
            if self._slice is not None:
                whole, start = self._slice
                return whole.raw(x2)[:, start : start + self.out_features]
            q, s = quantize_rows(x2)
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                q, 1.0, 128, self.packed_w8a8()
            ).mul_(s)
        if x2.shape[0] == 1:  # oneDNN's one-row bfloat16 path is a slow gemv; two rows take the AMX gemm
            return F.linear(x2.repeat(2, 1), self.w16)[:1]
        return F.linear(x2, self.w16)

    def _scale_zero(self) -> torch.Tensor:
        """scale_zero as the int4 kernel must get it: contiguous (a strided view gives wrong products)."""
        sz = self.scale_zero
        return sz if sz.is_contiguous() else sz.contiguous()

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype this projection's kernel takes its input in: bfloat16, or float32 for the kquant kinds
        (the kernel quantizes float32 rows itself; a bfloat16 round trip would only cost two copies)."""
        return torch.float32 if self.kind in _KQ_KINDS else _ACT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)  # [M, K]
        chunk = prefill_rows(x)
        if self.kind == "int8" and chunk >= INT8_GEMM_ROWS:  # prefill: int8 values are exact in bfloat16
            y = F.linear(x2, self.w8.to(_ACT)) * self.scale
        elif self.kind == "int4" and chunk >= INT4_GEMM_ROWS and int4_layout_known(self.out_features):
            y = torch.cat(
                [
                    x2 @ unpack_int4(self.packed, self.scale_zero, s, min(s + INT4_SLICE, self.out_features))
                    for s in range(0, self.out_features, INT4_SLICE)
                ],
                dim=1,
            )
        else:  # the packed kernels (and bfloat16's gemm)
            y = self.raw(x2)
        y = y.to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def int8_weight(self) -> torch.Tensor:
        """w8a8: the int8 weight [N, K] (as given before packing, else read back from fbgemm's packed weight,
        or the whole's rows)."""
        if self._slice is not None:
            whole, start = self._slice
            return whole.int8_weight()[start : start + self.out_features]
        if self._w8 is not None:
            return self._w8
        return torch.ops.quantized.linear_unpack(self._w8a8)[0].int_repr()

    def dequantized(self) -> torch.Tensor:
        """The weight this projection multiplies by, as float32 [N, K] (tests compare against it)."""
        if self.kind == "w8a8":
            return self.int8_weight().float() * self.scale.float()[:, None]
        if self.kind in _KQ_KINDS:
            from redwood.cpu_kernels import kquant

            return kquant.unpack(self.kq, self.type_name)[:, : self.in_features]
        if self.kind == "int8":
            return self.w8.float() * self.scale.float()[:, None]
        if self.kind == "int4":
            eye = torch.eye(self.in_features, dtype=_ACT)  # x = I reads Wᵀ back out of the kernel exactly
            return (
                torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, self._scale_zero()).float().T
            )
        return self.w16.float()

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: the packed weight, its scales (and zeros) and the bias (w8a8: N × K bytes
        of fbgemm's packed weight and its int32 column offsets, next to the buffers)."""
        packed = self.out_features * (self.in_features + 4) if self.kind == "w8a8" else 0
        return packed + sum(b.nbytes for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.in_features} → {self.out_features}, {self.kind}, bias={self.bias is not None}"


def can_concat(linears: list) -> bool:
    """Whether `PackedLinear.concat` takes these projections: all PackedLinear of one kind, int8 or int4
    (bfloat16's oneDNN gemm may block a wider output differently) or w8a8 (each output column's integer sum
    is exact, whatever the packing), one in_features, a bias on all or none;
    int4 members with out_features % 64 == 0 (the packed layout's row block, so the members' packed rows
    concatenate into the whole's)."""
    if not linears or not all(isinstance(m, PackedLinear) for m in linears):
        return False
    first = linears[0]
    return (
        first.kind in ("int8", "int4", "w8a8") + _KQ_KINDS
        and all(m.kind == first.kind for m in linears)
        and (first.kind not in _KQ_KINDS or all(m.type_name == first.type_name for m in linears))
        and all(m.in_features == first.in_features for m in linears)
        and len({m.bias is None for m in linears}) == 1
        and (first.kind != "int4" or all(m.out_features % 64 == 0 for m in linears))
    )


# Output rows quantized at a time: the float temporaries are one slice's (a 1.5B's tied head is 0.9 GB in
# float32), not the whole matrix's. A multiple of 64, the int4 layout's row block.
PACK_ROWS = 4096


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (int8 [N, K], bfloat16 scales [N]) for `_weight_int8pack_mm`: symmetric per row.
    The kernel reads a bfloat16 scale: quantize against that one, rounded up (×(1 + 2⁻⁸) before rounding
    to nearest) so ±amax stays within ±127 steps. In slices of PACK_ROWS rows."""
    N, K = w.shape
    w8, scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N, dtype=_ACT)
    for s in range(0, N, PACK_ROWS):
        lo, hi = torch.aminmax(w[s : s + PACK_ROWS], dim=1)
        sc = (torch.maximum(-lo, hi) / 127 * (1 + 2**-8)).clamp_min(1e-12).to(_ACT)  # (max |w| per row)
        q = w[s : s + PACK_ROWS] / sc.float()[:, None]
        w8[s : s + PACK_ROWS] = q.round_().clamp_(-127, 127)  # (integral values: the int8 cast is exact)
        scale[s : s + PACK_ROWS] = sc
    return w8, scale


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (packed uint8 weight for `_weight_int4pack_mm_for_cpu`, scales and zeros
    [K / group, N, 2] bfloat16). Per group of `group` inputs: scale = (max − min) / 15, zero = min + 8 ·
    scale, q = round((w − min) / scale) ∈ [0, 15], so w ≈ (q − 8) · scale + zero. In slices of PACK_ROWS
    rows where the packed layout is known to be per 64-row block (`int4_layout_known`)."""
    N, K = w.shape
    if N > PACK_ROWS and int4_layout_known(N):
        parts = [quantize_int4(w[s : s + PACK_ROWS], group) for s in range(0, N, PACK_ROWS)]
        return torch.cat([p for p, _ in parts]), torch.cat([sz for _, sz in parts], dim=1)
    g = w.reshape(N, K // group, group)
    lo, hi = torch.aminmax(g, dim=-1)  # [N, K / group]
    # The kernel sees a bfloat16 scale and zero: quantize against those (the scale rounded up, as for int8).
    scale_b = ((hi - lo) / 15 * (1 + 2**-8)).clamp_min(1e-12).to(_ACT)
    zero_b = (lo + 8 * scale_b.float()).to(_ACT)
    q = (g - zero_b.float()[..., None]).div_(scale_b.float()[..., None]).add_(8).round_().clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), 1)
    scale_zero = torch.stack([scale_b, zero_b], -1).transpose(0, 1).contiguous()  # [K / group, N, 2]
    return packed, scale_zero


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 (any integer dtype) → the int4 kernel's packed weight, in slices of PACK_ROWS rows
    where the layout is per 64-row block (`int4_layout_known`), else at once."""
    N = q.shape[0]
    step = PACK_ROWS if int4_layout_known(N) else N
    return torch.cat(
        [
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[s : s + step].to(torch.int32), 1)
            for s in range(0, N, step)
        ]
    )


def int4_scale_zero(step: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's bfloat16 (scale, zero) for groups whose values are q · step − offset, q ∈ [0, 15]
    (a GGUF 4-bit grid). The kernel computes (q − 8) · scale + zero in float32 (measured: its products equal
    float64 products with that weight, rounded once to bfloat16), so the error at level q is
    e(q) = q · (scale − step) + zero − 8 · scale + offset: linear in q. scale = step rounded to bfloat16;
    zero balances e(0) = −e(15): zero* = 8 · scale − offset − 7.5 · (scale − step), rounded to bfloat16.
    Hence |e| ≤ 7.5 · |scale − step| + |zero − zero*| ≤ 2⁻⁸ · (7.5 · |step| + |zero*|) (bfloat16's unit
    roundoff): on real Q4_K tensors a small fraction of a step, well below re-quantizing the file's floats
    (`quantize_int4`: up to half a step) and below int8's per-row grid (docs/perf/cpu.md, "Figures cited
    from the source")."""
    scale = step.to(_ACT)
    zero = (8 * scale.float() - offset - 7.5 * (scale.float() - step)).to(_ACT)
    return scale, zero


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] → (q float32 [M, K], integers in [−127, 127]; s float32 [M, 1]) with q · s ≈ x2, each row
    on its own: s = max |x| / 127 (rows of zeros: any s, q = 0). Float32 ops on each row alone, so a row's
    (q, s) does not depend on the other rows."""
    xf = x2.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min_(1e-30).div_(127)
    return xf.div(s).round_(), s


def pack_w8a8(w8: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed weight (torch.ops.quantized.linear_prepack, engine "fbgemm") of int8 w8 [N, K] with
    per-row scales [N] (symmetric: zero points 0); the op then returns float32 acc · (1 · scale[n]) — exactly
    float32(int32 acc) × scale[n] (measured equal to `torch._int_mm`'s sums so scaled)."""
    import warnings

    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch 2.13 marks quantized tensors deprecated)
            zeros = torch.zeros(len(scale), dtype=torch.long)
            qw = torch._make_per_channel_quantized_tensor(w8, scale.double(), zeros, 0)
            return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = before


_W8A8_EXACT: list[bool] = []  # (a one-time probe)


def w8a8_exact() -> bool:
    """Whether this torch build and CPU multiply w8a8 exactly: fbgemm present, and its sums of 255 · 127
    pairs not saturated (fbgemm's AVX2 / AVX-512 kernels without VNNI add u8 × s8 pairs in int16, which
    saturates at 32767; VNNI's vpdpbusd does not), checked against the exact product once."""
    if not _W8A8_EXACT:
        from redwood.cpu_kernels import isa

        # (under an ISA cap without VNNI, answer as such a CPU does: fbgemm picks its kernel by itself)
        ok = "fbgemm" in torch.backends.quantized.supported_engines and isa.allows("avx512_vnni")
        if ok:
            w8 = torch.full((64, 256), 127, dtype=torch.int8)
            w8[1::2] = -127
            x = torch.full((2, 256), 127.0)
            x[1] = -127
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                x, 1.0, 128, pack_w8a8(w8, torch.ones(64))
            )
            ok = torch.equal(y, x @ w8.float().T)
        _W8A8_EXACT.append(bool(ok))
    return _W8A8_EXACT[0]


_INT4_LAYOUT: list[bool] = []  # (a one-time probe: [] until checked)


def int4_layout_known(out_features: int) -> bool:
    """Whether `unpack_int4` can read this torch build's int4 layout for `out_features` rows: the CPU pack
    (AVX-512 builds) stores each block of 64 output rows as [K, 32] bytes — low nibble row j, high nibble
    row 32 + j. Probed once against `_convert_weight_to_int4pack_for_cpu`; another layout (other CPU
    builds) keeps every forward in torch's kernel."""
    if out_features % 64:
        return False
    if not _INT4_LAYOUT:
        q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        b = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        ok = b.shape == (128, 32) and b.dtype == torch.uint8
        if ok:
            b = b.view(2, 64, 32)
            ok = torch.equal(torch.cat([b & 15, b >> 4], 2).transpose(1, 2).reshape(128, 64).int(), q)
        _INT4_LAYOUT.append(bool(ok))
    return _INT4_LAYOUT[0]


def unpack_int4(packed: torch.Tensor, scale_zero: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Output rows [start, end) (multiples of 64) of an int4-packed weight, transposed: bfloat16 [K, end −
    start] = (q − 8) · scale + zero per INT4_GROUP inputs, rounded once — the weight the int4 kernel
    multiplies by (`dequantized` reads it through the kernel: the same values). Transposed because each
    64-row block is stored as [K, 64] nibbles: Wᵀ is a copy in runs of 64, W an element-wise transpose
    (slower: docs/perf/cpu.md, session 12)."""
    n, K = end - start, packed.shape[1] * 2
    b = packed[start:end].view(n // 64, K, 32)
    q = torch.cat([b & 15, b >> 4], dim=2)  # [n / 64, K, 64]: row 64·i + j of the slice at [i, :, j]
    wt = torch.empty(K, n // 64, 64, dtype=_ACT).copy_(q.transpose(0, 1)).view(K // INT4_GROUP, INT4_GROUP, n)
    scale, zero = scale_zero[:, start:end, 0][:, None], scale_zero[:, start:end, 1][:, None]  # [K / group, 1, n]
    return torch.addcmul(zero, wt.sub_(8), scale).view(K, n)


def check_packable(weight: torch.Tensor | tuple[int, int], kind: str) -> str | None:
    """Why a weight [N, K] (or its shape) cannot take `kind` (None when it can). int4: the packing needs
    N % 16 == 0 and whole groups along K. int8: torch 2.13's kernel needs K % 16 == 0 (measured: K = 8, 24,
    1000 give wrong products, K = 5 crashes; every multiple of 16 tried matched)."""
    N, K = weight.shape if isinstance(weight, torch.Tensor) else weight
    if kind == "int4" and (N % 16 or K % INT4_GROUP):
        return f"int4 needs out_features % 16 == 0 and in_features % {INT4_GROUP} == 0; this projection is {N}×{K}"
    if kind == "int8" and K % 16:
        return f"int8 needs in_features % 16 == 0; this projection is {N}×{K}"
    if kind == "w8a8" and not w8a8_exact():
        return "w8a8 needs fbgemm's exact int32 sums (an AVX512-VNNI CPU); this torch build / CPU failed the probe"
    if kind in _KQ_KINDS:
        from redwood.cpu_kernels import kquant

        why = kquant.why_unavailable()
        return f"{kind}'s kernel (kquant) cannot run here: {why}" if why else None
    return None


# The tensors `packer` packs as they load (Hugging Face names): every decoder-layer projection and an untied head.
_PACKED_NAMES = re.compile(
    r"^(model\.)?(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)|lm_head)\.weight$"
)


def file_kind(shape: tuple[int, int], fmt: str = FILE_FORMAT) -> str:
    """The format a projection the file format `fmt` does not keep in its own blocks (a non-4-bit GGUF type
    under FILE_FORMAT, a type other than Q4_K / Q6_K / Q8_0 / Q5_0 under KQUANT, or a tied head) gets: w8a8 under
    KQUANT where it is exact here, else int8, or bfloat16 where int8's kernel cannot take the shape."""
    if fmt == KQUANT and check_packable(shape, "w8a8") is None:
        return "w8a8"
    return "int8" if check_packable(shape, "int8") is None else "bfloat16"


class _Packer:
    """A transform for a loader that hands over each float tensor as it is read (`read_gguf(transform=)`):
    a projection weight or an untied LM head becomes its PackedLinear (bias None; `build_model` sets it)
    right away, so a load holds the packed model plus about one float tensor instead of the whole float
    model and then its packed copy. A head `kind` cannot tile stays float (as in quantize_cpu). `cast`:
    the dtype each float tensor is cast to first (the same packed values as packing a model loaded in it).
    FILE_FORMAT: 4-bit group tensors are taken as groups (`takes_int4_groups` / `from_int4_groups`); KQUANT:
    Q4_K / Q6_K / Q8_0 / Q5_0 tensors as their raw blocks (`takes_blocks` / `from_blocks`)."""

    def __init__(self, kind: str, cast: torch.dtype | None = None):
        self.kind, self.cast = kind, cast

    def takes_int4_groups(self, name: str, shape: tuple[int, int]) -> bool:
        return (
            self.kind == FILE_FORMAT
            and bool(_PACKED_NAMES.match(name))
            and check_packable(tuple(shape), "int4") is None
        )

    def from_int4_groups(self, name: str, q, step, offset) -> PackedLinear:
        return PackedLinear.from_int4_groups(q, step, offset)

    def takes_blocks(self, name: str, type_name: str, shape: tuple[int, int]) -> bool:
        from redwood.cpu_kernels import kquant

        return (
            self.kind == KQUANT
            and bool(_PACKED_NAMES.match(name))
            and type_name in kquant.TYPES
            and shape[1] % kquant.FILE_BLOCK[type_name] == 0
        )

    def from_blocks(self, name: str, rows: torch.Tensor, type_name: str) -> PackedLinear:
        return PackedLinear.from_kquant(rows, type_name)

    def __call__(self, name: str, w: torch.Tensor):
        if not _PACKED_NAMES.match(name):
            return w
        kind = file_kind(tuple(w.shape), self.kind) if self.kind in FILE_FORMATS else self.kind
        if check_packable(w, kind) is not None:
            return w
        return PackedLinear(w if self.cast is None else w.to(self.cast), None, kind)


def packer(kind: str, cast: torch.dtype | None = None) -> _Packer:
    """The load-time transform packing projections in `kind` (a WEIGHT_FORMATS entry or FILE_FORMAT)."""
    return _Packer(kind, cast)


WEIGHT_CHOICES = ("auto",) + WEIGHT_FORMATS + FILE_FORMATS
# "auto" on the CPU for a GGUF file (`gguf_default`): the fastest formats at the file's quality on this project's
# 2-core machine (an AMD EPYC with AVX-512 VNNI), measured side by side (docs/perf/cpu.md, session 16):
# the target in kquant (the file's Q4_K / Q6_K blocks × int8 activations: faster than w8a8), the draft in q4k
# (session 29: the 0.5B's own Q5_0 / Q8_0 blocks under kquant are more faithful but 23–34% slower a draft step,
# so speculation with them was 5–10% slower)
# (re-quantized to Q4_K: a draft level reads fewer bytes; only acceptance changes), where the kquant kernel
# builds and runs (`kquant.why_unavailable`). Else w8a8 for both where fbgemm's int8 sums are exact
# (`w8a8_exact`, docs/perf/cpu.md, session 15), else the target in the file's own types and the draft in
# int4 (sessions 12–13 there). A draft whose shapes a format cannot pack falls back (`auto_formats`).
GGUF_DEFAULT, DRAFT_GGUF_DEFAULT = KQUANT, "q4k"
W8A8_DEFAULT = "w8a8"  # (target and draft) where the kquant kernel cannot run but w8a8 is exact
GGUF_FALLBACK = FILE_FORMAT
DRAFT_GGUF_FALLBACK = "int4"


def gguf_default(draft: bool = False) -> str:
    """What "auto" gives a GGUF file on the CPU (a draft model's with `draft`): kquant / q4k where the kquant
    kernel runs, else w8a8 where `w8a8_exact`, else the fallbacks (comment above)."""
    why = check_packable((1, 256), KQUANT)
    if why is None:
        return DRAFT_GGUF_DEFAULT if draft else GGUF_DEFAULT
    if "lacks" not in why:  # a CPU that could run it, but the kernel did not build: say so (once) and go on
        import warnings

        warnings.warn(
            f"{why}; CPU weights fall back to {W8A8_DEFAULT if w8a8_exact() else GGUF_FALLBACK} "
            f"(slower: install g++ and run scripts/setup.sh, or pass --weights)",
            stacklevel=2,
        )
    if w8a8_exact():
        return W8A8_DEFAULT
    return DRAFT_GGUF_FALLBACK if draft else GGUF_FALLBACK


def check_weights(weights: str, device: torch.device, offload: bool = False, name: str = "weights") -> None:
    """A ConfigError for an unknown weights value, or a CPU format asked for a model that runs on CUDA
    (`name`: the option's name in the message, "weights" or "draft_weights")."""
    from redwood.errors import ConfigError

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"unknown {name} {weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    if weights not in ("auto", "float32") and (device.type != "cpu" or offload):
        raise ConfigError(
            f"{name}={weights!r} is a CPU format; on CUDA the model runs in its dtype "
            f"(--dtype bfloat16; a draft model can use draft_weights int8)"
        )


CUDA_DRAFT_WEIGHTS = ("auto", "float32", "int8")  # a draft model's formats on CUDA (`draft_weights_on`)


def draft_weights_on(weights: str, device: torch.device) -> tuple[str, str | None]:
    """What a draft model's `draft_weights` means on `device`: (the format it loads in — `load_model`'s
    weights — and the scheme of the int8 copies its one-token forwards read, `Transformer.quantize_skinny`,
    or None). On the CPU every CPU format (`WEIGHT_CHOICES`); on CUDA auto / float32 (the model's dtype) or
    int8 (int8 copies for the one-token forwards); anything else is a ConfigError, raised before any weight
    loads."""
    from redwood.errors import ConfigError

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"unknown draft_weights {weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
    if device.type == "cpu":
        return weights, None
    if weights not in CUDA_DRAFT_WEIGHTS:
        raise ConfigError(
            f"draft_weights={weights!r} is a CPU format; on CUDA a draft model takes auto or "
            f"float32 (its dtype) or int8 (int8 copies for its one-token forwards)"
        )
    return ("auto", "int8") if weights == "int8" else (weights, None)


def resolve_weights(weights: str, device: torch.device, path, draft: bool = False) -> str:
    """The format a model loaded from `path` onto `device` gets: "auto" → `gguf_default(draft)` for a .gguf
    file on the CPU, else float32 (a float checkpoint stays exact; CUDA keeps its own path)."""
    from redwood.errors import ConfigError

    name = "draft_weights" if draft else "weights"
    check_weights(weights, device, name=name)
    if weights in FILE_FORMATS and not str(path).endswith(".gguf"):
        raise ConfigError(
            f"{name}={weights!r} keeps a GGUF file's own quantization, and {path} is not a "
            f".gguf file; choose one of {', '.join(WEIGHT_FORMATS)} (or auto)"
        )
    if weights != "auto":
        return weights
    if device.type == "cpu" and str(path).endswith(".gguf"):
        return gguf_default(draft)
    return "float32"


def auto_formats(kind: str) -> tuple[str, ...]:
    """What "auto" tries, in order, when it resolved to `kind`: a model whose shapes a format cannot pack
    takes the next one (int4 → int8 → float32; w8a8 / kquant / q4k → w8a8 → int8 → float32) instead of an
    error."""
    if kind in (KQUANT, "q4k"):
        return (kind, "w8a8", "int8", "float32")
    if kind == "w8a8":
        return ("w8a8", "int8", "float32")
    order = ("int4", "int8", "float32")
    return order[order.index(kind) :] if kind in order else (kind,)
