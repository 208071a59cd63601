"""Every environment variable redwood reads, one entry each: its name, default, allowed values and one line of
doc. Code reads a setting with `envs.get(NAME)`; nothing else in redwood reads `os.environ` for a REDWOOD_
setting, so this file is the whole list (`redwood doctor`-style reports print `envs.describe()`).

A value outside a setting's choices is a `ConfigError` naming the choices — never a silent fallback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from redwood.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    doc: str
    choices: tuple[str, ...] | None = None  # None: any string


SETTINGS: dict[str, Setting] = {}


def _register(name: str, default: str, doc: str, choices: tuple[str, ...] | None = None) -> str:
    SETTINGS[name] = Setting(name, default, doc, choices)
    return name


HOME = _register(
    "REDWOOD_HOME",
    "",
    "where redwood keeps downloaded models and datasets (default ~/.cache/redwood): models/<name>/, data/.",
)

CPU_ISA = _register(
    "REDWOOD_CPU_ISA",
    "native",
    "cap the CPU features redwood's own kernels and format choices use: native (all the CPU reports), "
    "avx2 (as an AVX2-only CPU: no AVX-512, no VNNI, no AMX), portable (as an x86 CPU without AVX, FMA or F16C; an ARM one without DOTPROD). "
    "With ATEN_CPU_CAPABILITY=avx2 it runs the suite as an AVX2 machine would on an AVX-512 one.",
    ("native", "avx2", "portable"),
)

CPU_KERNEL = _register(
    "REDWOOD_CPU_KERNEL",
    "auto",
    "which build of the CPU kquant kernel and C++ decoder layer runs (redwood.cpu_kernels.kquant): auto (the "
    "fastest this CPU runs, under REDWOOD_CPU_ISA: avx512, else avx2, else neon on ARM, else portable), or one of "
    "avx512, avxvnni, avx2, neon, portable (all compute the same bits); forcing one the CPU lacks is an error.",
    ("auto", "avx512", "avxvnni", "avx2", "neon", "portable"),
)

TP_TIMEOUT = _register(
    "REDWOOD_TP_TIMEOUT",
    "300",
    "seconds a tensor-parallel collective (and joining the group) may wait for the other ranks before every "
    "rank stops with an error naming the failure; a rank that dies ends the others' waits at once.",
)


def get(name: str) -> str:
    """The setting's value from the environment (its default when unset or empty), checked against its
    choices."""
    s = SETTINGS[name]
    value = os.environ.get(name, "").strip() or s.default
    if s.choices is not None and value not in s.choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(s.choices)} ({s.doc})")
    return value


def describe() -> list[tuple[str, str, str]]:
    """(name, value, doc) for every setting, the values as this process reads them."""
    return [(s.name, os.environ.get(s.name, "") or s.default, s.doc) for s in SETTINGS.values()]
