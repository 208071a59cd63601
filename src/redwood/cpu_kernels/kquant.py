"""Q4_K / Q6_K / Q8_0 / Q5_0 GGUF blocks × int8 activations on the CPU (kquant.cpp), built on first use, one build
per ISA.

`kquant_linear(x, blocks, type_name)` multiplies float32 activations x [M, K] by a weight kept as the GGUF
file's own blocks (uint8 [N, ceil(K / 256) · block bytes]: super-blocks of 256 values; Q8_0 / Q5_0 take 8 of
their 32-value blocks a super-block and pad a row to whole ones with zero blocks); each activation row is quantized
per 256 values to int8 and every super-block's dot product is integer arithmetic, so the bytes read per token are
the file's and each output row depends only on its own input row (the kernel's docstring).

Variants (kquant.h, kq_simd.h): the same C++ built for several instruction sets — avx512 (AVX-512 VNNI's
vpdpbusd), avxvnni (the 256-bit VEX vpdpbusd), avx2 (vpmaddubsw + vpmaddwd, within their int16 saturation
bound), neon (aarch64 DOTPROD's sdot; tested here cross-compiled under qemu-user, not yet run on an ARM machine)
and portable (plain C++, any CPU) — each its own extension (`redwood_cpu_kquant_<variant>`) with its own
operator namespace (`redwood_kq_<variant>`), so several can load in one process. They share one packed layout
and compute the same bits (tested). The fastest the CPU runs (its /proc/cpuinfo flags under REDWOOD_CPU_ISA:
`isa`) is chosen once, on first use: `AUTO` in order, a variant whose build fails warning once and giving way to
the next. REDWOOD_CPU_KERNEL forces one (`envs`; one the CPU lacks is a ConfigError). avxvnni comes after avx512
(a CPU with both runs the 512-bit one) and before avx2: it has run on an AVX-VNNI CPU (the GPU host's Xeon, session
28: its core and its operators bit-equal to avx512's, avx2's and portable's; its speed against avx2 there is not
measured yet). `variant()` names the choice; every caller reaches the operators through `ops()`.

The kernel is C++ compiled with the machine's g++ the first time it is needed (tens of seconds a variant, then
cached by torch.utils.cpp_extension under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). `available()`
says whether some variant runs here (a C++ compiler and a build that succeeds); `why_unavailable()` says why not.

The wrappers here check their arguments in Python before calling the C++ ops (which check them again): on
some torch builds an exception thrown by a JIT-built extension kills the process instead of raising
(a minimal TORCH_CHECK extension crashes that way on one such build: docs/perf/cpu.md, session 17),
so bad input must never depend on the C++ checks.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch

from redwood import envs
from redwood.cpu_kernels import isa
from redwood.errors import ConfigError

log = logging.getLogger(__name__)

# name -> (ggml type id, bytes per 256 values in the file, bytes per super-block of 256 in the kernel's layout).
# Q8_0 / Q5_0 are blocks of 32 values in the file (34 / 22 bytes); the kernel takes 8 of them as one super-block
# (272 / 176 bytes: the file's bytes re-laid, kquant.cpp) and pads a row whose K is not a multiple of 256 with
# zero blocks.
TYPES = {"Q4_K": (12, 144, 148), "Q6_K": (14, 210, 210), "Q8_0": (8, 272, 272), "Q5_0": (6, 176, 176)}
BLOCK = 256
FILE_BLOCK = {"Q4_K": 256, "Q6_K": 256, "Q8_0": 32, "Q5_0": 32}  # values in one block of the file


def file_block_bytes(type_name: str) -> int:
    """Bytes of one block of the file (FILE_BLOCK values)."""
    return TYPES[type_name][1] * FILE_BLOCK[type_name] // BLOCK


def file_row_values(type_name: str, row_bytes: int) -> int:
    """K of a file row of `row_bytes` (whole file blocks)."""
    return row_bytes // file_block_bytes(type_name) * FILE_BLOCK[type_name]


def packed_row_bytes(type_name: str, k: int) -> int:
    """Bytes of a packed row of k values (whole super-blocks: 32-value block types padded with zero blocks)."""
    return padded(k) // BLOCK * TYPES[type_name][2]


# variant -> (the cpuinfo flags it needs, its compiler flags); fastest first
VARIANTS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma"),
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512dq", "-mf16c", "-mfma"],
    ),
    "avxvnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "neon": (("asimddp",), ["-march=armv8.2-a+dotprod"]),  # (aarch64: /proc/cpuinfo's Features)
    "portable": ((), []),
}
AUTO = ("avx512", "avxvnni", "avx2", "neon", "portable")  # what auto tries, in order
# every variant: -ffp-contract=off (no multiply-add fused unless written so: the variants' bits agree)
_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
SOURCES = ("kquant.cpp", "layer.cpp", "ops.cpp")  # (kquant.cpp, layer.cpp: the torch-free core; ops.cpp: the ops)


def namespace(name: str) -> str:
    """The torch operator namespace of a variant's build (torch.ops.<namespace>)."""
    return f"redwood_kq_{name}"


def lacks(name: str, flags: frozenset[str] | None = None) -> list[str]:
    """The cpuinfo flags variant `name` needs that this CPU (under REDWOOD_CPU_ISA) lacks."""
    flags = isa.cpu_flags() if flags is None else flags
    return [f for f in VARIANTS[name][0] if f not in flags]


def supported() -> list[str]:
    """The variants this CPU can run (its flags under REDWOOD_CPU_ISA; nothing is built), fastest first."""
    return [name for name in VARIANTS if not lacks(name)]


def _compile(name: str) -> None:
    """Build (or find in the cache) and load variant `name`'s extension; raises on failure."""
    from torch.utils import cpp_extension

    here = Path(__file__).parent
    cpp_extension.load(
        name=f"redwood_cpu_kquant_{name}",
        sources=[str(here / s) for s in SOURCES],
        extra_cflags=_COMMON_FLAGS + VARIANTS[name][1] + [f"-DKQ_NS={namespace(name)}"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    built = getattr(torch.ops, namespace(name)).variant()
    if built != name:  # (the compiler did not define the macros the flags imply: kquant.h)
        raise RuntimeError(f"the {name} build computes with the {built} code")


@functools.lru_cache(maxsize=None)
def _build(name: str) -> str | None:
    """None once variant `name` is loaded, else the last line of why its build failed (tried once a process)."""
    try:
        _compile(name)
    except Exception as e:  # a failed build: reported, the caller falls back
        text = str(e).strip()
        return text.splitlines()[-1] if text else type(e).__name__
    return None


def _no_compiler() -> str | None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++) to build the kernel"
    return None


def _choose(setting: str, flags: frozenset[str]) -> tuple[str | None, str | None]:
    """(variant, None), or (None, why none runs), for REDWOOD_CPU_KERNEL = setting on a CPU with `flags` (called
    once per setting and flag set: `_current`)."""
    cap = f" (under {envs.CPU_ISA}={isa.capped()})" if isa.capped() else ""
    if setting != "auto":
        missing = lacks(setting, flags)
        if missing:
            raise ConfigError(f"{envs.CPU_KERNEL}={setting}: this CPU lacks {', '.join(missing)}{cap}")
    why = _no_compiler()
    if why:
        return None, why
    if setting != "auto":
        why = _build(setting)
        if why:
            warnings.warn(f"the {setting} CPU kernel (forced by {envs.CPU_KERNEL}) did not build: {why}", stacklevel=3)
            return None, f"building the {setting} kernel failed: {why}"
        log.info("CPU kernels: the %s build (forced by %s)", setting, envs.CPU_KERNEL)
        return setting, None
    failed = []
    candidates = [name for name in AUTO if not lacks(name, flags)]
    for i, name in enumerate(candidates):
        why = _build(name)
        if why is None:
            log.info("CPU kernels: the %s build, the fastest this CPU runs%s", name, cap)
            return name, None
        failed.append(f"{name}: {why}")
        nxt = f"falling back to {candidates[i + 1]}" if i + 1 < len(candidates) else "no other build left"
        warnings.warn(f"the {name} CPU kernel did not build ({why}); {nxt}", stacklevel=3)
    return None, "building the kernel failed (" + "; ".join(failed) + ")"


# (REDWOOD_CPU_KERNEL, the CPU's flags under REDWOOD_CPU_ISA) -> `_choose`'s answer: each choice is made (and
# logged, and a failed build warned about) once a process
_CHOICES: dict[tuple[str, frozenset[str]], tuple[str | None, str | None]] = {}


def _current() -> tuple[str | None, str | None]:
    key = (envs.get(envs.CPU_KERNEL), isa.cpu_flags())
    got = _CHOICES.get(key)
    if got is None:
        got = _CHOICES[key] = _choose(*key)
    return got


def variant() -> str | None:
    """The variant this process runs ("avx512", "avxvnni", "avx2", "neon" or "portable"; chosen and built on first call),
    or None where none can run (`why_unavailable`). A ConfigError where REDWOOD_CPU_KERNEL forces one the CPU
    lacks."""
    return _current()[0]


def why_unavailable() -> str | None:
    """None when a variant is built and loaded; else the reason none can run here."""
    return _current()[1]


def available() -> bool:
    return why_unavailable() is None


def chosen() -> str | None:
    """The variant this process runs if it has been chosen already (None before the first use, or where none runs),
    without choosing or building one: for reports."""
    got = _CHOICES.get((envs.get(envs.CPU_KERNEL), isa.cpu_flags()))
    return got[0] if got else None


def describe() -> str:
    """One line for `redwood --version` and reports: the build this process runs (choosing and building it if need
    be), what chose it, and every build this CPU runs; or why none runs. Never raises (a bad setting is the line)."""
    try:
        name, why = _current()
        forced = envs.get(envs.CPU_KERNEL) != "auto"
    except ConfigError as e:
        return f"CPU kernels: none ({e})"
    if name is None:
        return f"CPU kernels: none ({why})"
    cap = f" under {envs.CPU_ISA}={isa.capped()}" if isa.capped() else ""
    how = f"forced by {envs.CPU_KERNEL}" if forced else "auto"
    return f"CPU kernels: {name} ({how}; this CPU runs {', '.join(supported())}{cap})"


def variant_unavailable(name: str) -> str | None:
    """None when variant `name` runs here (built and loaded: its CPU flags, a compiler, a build); else why not."""
    missing = lacks(name)
    if missing:
        cap = f" (under {envs.CPU_ISA}={isa.capped()})" if isa.capped() else ""
        return f"this CPU lacks {', '.join(missing)}{cap}"
    why = _no_compiler()
    if why:
        return why
    why = _build(name)
    return None if why is None else f"building the {name} kernel failed: {why}"


def ops(name: str | None = None):
    """The operators (torch.ops namespace) of variant `name`, default the chosen one — kquant_linear, kquant_pack,
    decoder_layer (layer.cpp), variant. RuntimeError where it cannot run."""
    if name is None:
        name, why = _current()
    else:
        if name not in VARIANTS:
            raise ValueError(f"unknown kquant variant {name!r}; one of {', '.join(VARIANTS)}")
        why = variant_unavailable(name)
    if why:
        raise RuntimeError(f"the kquant kernel cannot run here: {why}")
    return getattr(torch.ops, namespace(name))


def _type(type_name: str) -> tuple[int, int, int]:
    if type_name not in TYPES:
        raise ValueError(f"the kquant kernel takes {', '.join(TYPES)} blocks, not {type_name!r}")
    return TYPES[type_name]


def pack(rows: torch.Tensor, type_name: str, variant: str | None = None) -> torch.Tensor:
    """A tensor's file rows (uint8 [N, K / FILE_BLOCK · file block bytes]) in the kernel's layout
    (uint8 [N, ceil(K / 256) · kernel bytes]): Q6_K as in the file, values in the kernel's order, Q4_K's 6-bit
    scales and mins unpacked to bytes (148 bytes a super-block, Q6_K 210 as in the file); Q8_0 / Q5_0 as 8 file
    blocks a super-block (272 / 176 bytes; the last padded with zero blocks where K is not a multiple of 256). The
    same values (kquant.cpp); one layout for every variant (`variant`: whose operator packs, default the chosen
    one; the same bytes)."""
    type_id = _type(type_name)[0]
    per = file_block_bytes(type_name)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] % per:
        raise ValueError(
            f"kquant_pack: w must be a contiguous uint8 [N, K / {FILE_BLOCK[type_name]} * {per}] tensor, got "
            f"{rows.dtype} {list(rows.shape)}"
        )
    return ops(variant).kquant_pack(rows.contiguous(), type_id)


def kquant_linear(x: torch.Tensor, packed: torch.Tensor, type_name: str, variant: str | None = None) -> torch.Tensor:
    """float32 [M, N] = x [M, K] (float32) · Wᵀ, W a Q4_K / Q6_K / Q8_0 / Q5_0 tensor in the kernel's layout
    (`pack`), by `variant` (default the chosen one; every variant gives the same bits). K: a multiple of the
    type's file block (256; 32 for Q8_0 / Q5_0, whose packed rows are padded to whole super-blocks)."""
    type_id = _type(type_name)[0]
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"kquant_linear: x must be a contiguous float32 [M, K] tensor, got {x.dtype} {list(x.shape)}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError("kquant_linear: w must be a contiguous uint8 [N, row bytes] tensor")
    K, fv = x.shape[1], FILE_BLOCK[type_name]
    if K % fv or packed.shape[1] != packed_row_bytes(type_name, K):
        whole = "super-blocks of 256" if fv == BLOCK else f"blocks of {fv}"
        raise ValueError(
            f"kquant_linear: K = {K} needs whole {whole} and packed rows of "
            f"{packed_row_bytes(type_name, K)} bytes, got {packed.shape[1]}"
        )
    return ops(variant).kquant_linear(x.contiguous(), packed, type_id)


def kernel_order() -> torch.Tensor:
    """int64 [256]: the value index each kernel position p of a super-block holds (p = 64c + 4l + t holds
    value 16l + 4c + t: kquant.cpp's `value_at`)."""
    p = torch.arange(BLOCK)
    return 16 * ((p % 64) // 4) + 4 * (p // 64) + p % 4


def unpack(packed: torch.Tensor, type_name: str) -> torch.Tensor:
    """The float32 weight [N, K] that packed rows (`pack`) multiply by: the file's values, computed as
    loading.gguf.dequantize computes them (bit for bit: tests/cpu_kernels/test_kquant.py); K whole super-blocks
    (a padded Q8_0 / Q5_0 row's zero blocks included)."""
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
    if type_name in ("Q8_0", "Q5_0"):
        d = b[..., 0:16].contiguous().view(torch.float16).float()  # [N, nb, 8]: one per 32 values
        if type_name == "Q8_0":
            q = b[..., 16:272].contiguous().view(torch.int8)[..., at]  # by value
        else:
            h, t = pos // 128, pos % 64  # nibbles as Q4_K's; high bit of position p: bit p // 32 of byte p % 32
            lo = (b[..., 16 + 64 * h + t] >> (4 * ((pos % 128) >= 64)).to(torch.uint8)) & 0x0F
            hi = (b[..., 144 + pos % 32] >> (pos // 32).to(torch.uint8)) & 1
            q = (lo | (hi << 4))[..., at].view(torch.int8) - 16  # by value
        return (q.float().view(N, nb, 8, 32) * d.unsqueeze(-1)).reshape(N, nb * BLOCK)
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
