"""The CPU features redwood may use: what /proc/cpuinfo reports, capped by REDWOOD_CPU_ISA (`envs`).

The cap lets one machine answer every capability probe as a smaller CPU would — which kquant kernel build
runs, fbgemm's exact w8a8 sums (VNNI) — so the tests and a user can run the AVX2 (or portable) paths on an
AVX-512 machine. torch's own kernels follow ATen's capability instead (ATEN_CPU_CAPABILITY=avx2).
"""

from __future__ import annotations

import functools

from redwood import envs


def _host_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags in `cpuinfo` (empty where it cannot be read: no flags, the portable build)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # (x86; ARM's line, e.g. "asimddp" for DOTPROD)
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _dropped_by(cap: str, flag: str) -> bool:
    """Whether the cap removes this cpuinfo flag (avx2: every AVX-512 extension, AVX-VNNI and AMX; portable:
    every AVX flag, AMX, FMA and F16C, and ARM's DOTPROD)."""
    if cap == "avx2":
        return flag.startswith(("avx512", "avx_vnni", "amx"))
    return cap == "portable" and flag.startswith(("avx", "amx", "fma", "f16c", "asimddp"))


@functools.lru_cache(maxsize=None)
def _flags(cap: str) -> frozenset[str]:
    return frozenset(f for f in _host_flags() if not _dropped_by(cap, f))


def cpu_flags() -> frozenset[str]:
    """The cpuinfo flags redwood may use on this machine (under the cap)."""
    return _flags(envs.get(envs.CPU_ISA))


def allows(flag: str) -> bool:
    """Whether the cap leaves this feature to redwood (True under native, whatever the CPU has)."""
    return not _dropped_by(envs.get(envs.CPU_ISA), flag)


def capped() -> str | None:
    """The cap's name when one is set, else None."""
    cap = envs.get(envs.CPU_ISA)
    return None if cap == "native" else cap
