"""triton, imported guarded, for the modules that hold Triton kernels (`redwood.kernels.fused`,
`redwood.attention.triton_decode`).

Without triton these modules still import: `triton` and `libdevice` are None, `jit` leaves a kernel a
plain (never called) function, and `tl.constexpr` exists so that kernel annotations resolve — the modules'
`available` checks then say False and callers use the PyTorch reference.
INTERPRET: TRITON_INTERPRET=1 was set when this module was imported (kernels run in Triton's CPU
interpreter, for tests).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None
    libdevice = None

    class tl:  # noqa: N801 — only so the kernels' annotations resolve
        constexpr = None


def jit(fn):
    """triton.jit, or `fn` unchanged when triton is missing."""
    return triton.jit(fn) if triton is not None else fn


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
