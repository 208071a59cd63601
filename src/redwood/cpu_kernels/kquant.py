"""Q4_K / Q6_K GGUF blocks × int8 activations on the CPU (kquant.cpp), built on first use.

`kquant_linear(x, blocks, type_name)` multiplies float32 activations x [M, K] by a weight kept as the GGUF
file's own super-blocks (uint8 [N, K / 256 · block bytes]); each activation row is quantized per 256 values
to int8 and every super-block's dot product is integer arithmetic (AVX-512 VNNI), so the bytes read per
token are the file's and each output row depends only on its own input row (the kernel's docstring).

The kernel is C++ compiled with the machine's g++ the first time it is needed (tens of seconds, then cached by
torch.utils.cpp_extension under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). `available()`
says whether this machine can run it (x86 with AVX-512 BW / VL / VNNI and F16C, a C++ compiler, and a build
that succeeds); `why_unavailable()` says why not.

The wrappers here check their arguments in Python before calling the C++ ops (which check them again): on
some torch builds an exception thrown by a JIT-built extension kills the process instead of raising
(a minimal TORCH_CHECK extension crashes that way on one such build: docs/perf/cpu.md, session 17),
so bad input must never depend on the C++ checks.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

from redwood.cpu_kernels import isa

# name -> (ggml type id, bytes per super-block of 256 in the file, in the kernel's layout)
TYPES = {"Q4_K": (12, 144, 148), "Q6_K": (14, 210, 210)}
BLOCK = 256
_FLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mavx512dq",
    "-mf16c",
    "-mfma",
    "-ffp-contract=off",
    "-fopenmp",
]
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c")


@functools.lru_cache(maxsize=1)
def why_unavailable() -> str | None:
    """None when the kernel is built and loaded; else the reason it cannot run here."""
    missing = [f for f in _CPU_FLAGS if f not in isa.cpu_flags()]
    if missing:
        cap = f" (under REDWOOD_CPU_ISA={isa.capped()})" if isa.capped() else ""
        return f"this CPU lacks {', '.join(missing)}{cap}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++) to build the kernel"
    try:
        _load()
    except Exception as e:  # a failed build: report it, callers fall back to another format
        return f"building the kernel failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    return None


def available() -> bool:
    return why_unavailable() is None


@functools.lru_cache(maxsize=1)
def _load() -> None:
    from torch.utils import cpp_extension

    here = Path(__file__).parent
    sources = [str(here / "kquant.cpp"), str(here / "layer.cpp")]  # (layer.cpp: the fused decoder layer)
    cpp_extension.load(
        name="redwood_cpu_kquant",
        sources=sources,
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _type(type_name: str) -> tuple[int, int, int]:
    if type_name not in TYPES:
        raise ValueError(f"the kquant kernel takes {' or '.join(TYPES)} blocks, not {type_name!r}")
    return TYPES[type_name]


def pack(rows: torch.Tensor, type_name: str) -> torch.Tensor:
    """A tensor's file rows (uint8 [N, K / 256 · file bytes]) in the kernel's layout: Q6_K as in the file,
    values in the kernel's order, Q4_K's 6-bit scales and mins unpacked to bytes (148 bytes a super-block,
    Q6_K 210 as in the file; the same values: kquant.cpp)."""
    type_id, file_bytes, _ = _type(type_name)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % file_bytes:
        raise ValueError(
            f"kquant_pack: w must be a contiguous uint8 [N, K / 256 * {file_bytes}] tensor, got "
            f"{rows.dtype} {list(rows.shape)}"
        )
    _load()
    return torch.ops.redwood_cpu.kquant_pack(rows.contiguous(), type_id)


def kquant_linear(x: torch.Tensor, packed: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 [M, N] = x [M, K] (float32) · Wᵀ, W a Q4_K / Q6_K tensor in the kernel's layout (`pack`)."""
    type_id, _, block_bytes = _type(type_name)
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"kquant_linear: x must be a contiguous float32 [M, K] tensor, got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError("kquant_linear: w must be a contiguous uint8 [N, row bytes] tensor")
    K = x.shape[1]
    if K % BLOCK or packed.shape[1] != K // BLOCK * block_bytes:
        raise ValueError(
            f"kquant_linear: K = {K} needs whole super-blocks of 256 and packed rows of "
            f"{K // BLOCK * block_bytes} bytes, got {packed.shape[1]}"
        )
    _load()
    return torch.ops.redwood_cpu.kquant_linear(x.contiguous(), packed, type_id)


def kernel_order() -> torch.Tensor:
    """int64 [256]: the value index each kernel position p of a super-block holds (p = 64c + 4l + t holds
    value 16l + 4c + t: kquant.cpp's `value_at`)."""
    p = torch.arange(BLOCK)
    return 16 * ((p % 64) // 4) + 4 * (p // 64) + p % 4


def unpack(packed: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 weight [N, K] that packed rows (`pack`) multiply by: the file's values, computed as
    loading.gguf.dequantize computes them (bit for bit: tests/cpu_kernels/test_kquant.py)."""
    N = packed.shape[0]
    nb = packed.shape[1] // _type(type_name)[2]
    b = packed.reshape(N, nb, TYPES[type_name][2])
    at = torch.empty(BLOCK, dtype=torch.long)
    at[kernel_order()] = torch.arange(BLOCK)  # value index -> kernel position
    pos = torch.arange(BLOCK)
    if type_name == "Q4_K":
        d, dmin = (
            b[..., 0:2].contiguous().view(torch.float16).float(),
            b[..., 2:4].contiguous().view(torch.float16).float(),
        )  # [N, nb, 1]
        sc, mn = b[..., 4:12].float(), b[..., 12:20].float()  # [N, nb, 8]
        qs = b[..., 20:148]
        h, t = pos // 128, pos % 64  # kernel position p: byte 64h + t, the high nibble from 64 on within the half
        q = (qs[..., 64 * h + t] >> (4 * ((pos % 128) >= 64)).to(torch.uint8)) & 0x0F  # [N, nb, 256] by position
        q = q[..., at].float().view(N, nb, 8, 32)  # by value
        return (q * (d * sc).unsqueeze(-1) - (dmin * mn).unsqueeze(-1)).reshape(N, nb * BLOCK)
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [N, nb, 1]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
    h, pp = pos // 128, pos % 128
    lo = (b[..., 64 * h + pp % 64] >> (4 * (pp >= 64)).to(torch.uint8)) & 0x0F
    hi = (b[..., 128 + pos % 64] >> (2 * (pos // 64)).to(torch.uint8)) & 3
    q = (lo | (hi << 4))[..., at].view(torch.int8) - 32  # by value
    return ((d * sc).unsqueeze(-1) * q.float().view(N, nb, 16, 16)).reshape(N, nb * BLOCK)


def padded(k: int) -> int:
    """in_features rounded up to whole super-blocks (`quantize_q4k` pads rows with zero weights)."""
    return -(-k // BLOCK) * BLOCK


def quantize_q4k(w: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """A float weight [N, K] as Q4_K super-blocks in the file's layout (uint8 [N, padded(K) / 256 · 144]),
    K padded with zeros to whole super-blocks. Per 32 values: scale = (max − min(min, 0)) / 15 and min =
    −min(min, 0); per super-block d = max scale / 63 and dmin = max min / 63 (fp16), the scales and mins
    rounded to 6 bits against them, then q = round((w + dmin·mn) / (d·sc)) in 0..15 — a plain min/max grid
    (no search), for drafts, whose weights change only the acceptance (verification is exact)."""
    N, K = w.shape
    Kp = padded(K)
    out = torch.empty(N, Kp // BLOCK * 144, dtype=torch.uint8)
    for s in range(0, N, chunk_rows):
        x = w[s : s + chunk_rows].float()
        if Kp != K:
            x = torch.nn.functional.pad(x, (0, Kp - K))
        n = x.shape[0]
        x = x.reshape(n, Kp // BLOCK, 8, 32)
        lo = x.amin(-1).clamp(max=0)  # [n, nb, 8]
        step, mins = (x.amax(-1) - lo) / 15, -lo
        d = (step.amax(-1) / 63).half()  # [n, nb]
        dmin = (mins.amax(-1) / 63).half()
        df, dminf = d.float().unsqueeze(-1), dmin.float().unsqueeze(-1)
        sc = torch.where(df > 0, step / df, torch.zeros_like(step)).round().clamp(0, 63)
        mn = torch.where(dminf > 0, mins / dminf, torch.zeros_like(mins)).round().clamp(0, 63)
        eff = (df * sc).unsqueeze(-1)  # [n, nb, 8, 1]
        q = torch.where(eff > 0, (x + (dminf * mn).unsqueeze(-1)) / eff, torch.zeros_like(x))
        q = q.round().clamp(0, 15).to(torch.uint8)  # [n, nb, 8, 32]
        sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
        blk = out[s : s + n].view(n, Kp // BLOCK, 144)
        blk[..., 0:2] = d.view(torch.uint8).view(n, -1, 2)
        blk[..., 2:4] = dmin.view(torch.uint8).view(n, -1, 2)
        blk[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
        blk[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
        blk[..., 12:16] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
        blk[..., 16:144] = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, -1, 128)
    return out
