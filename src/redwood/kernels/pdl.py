"""Programmatic dependent launch (PDL, compute capability ≥ 9) for the kernels of a captured step.

Inside a CUDA graph a batch-1 forward is a chain of small kernels, each of which waits for the previous
one to finish, then ramps up and starts reading its weights: a few microseconds per kernel of which
little is bytes (the draft's layers run well above their byte floor: docs/perf/gpu.md, session 5). A kernel
launched with PDL may start while the previous kernel in the stream is still running; it must execute `gdc_wait`
(griddepcontrol.wait: the previous grid has completed and its writes are visible) before it reads
anything an earlier kernel wrote, and before it writes anything. What it does before that wait is free
to overlap: the skinny matmuls prefetch their first weight tile into L2 there (hints only: the tile is
then read and summed by the same loop as without PDL, so results are the same bit for bit) — weights,
which nothing inside a forward writes. Each PDL kernel also signals `gdc_launch_dependents` at its
start, so the next one may be scheduled as soon as this one's last programs are running.

The launches are on only inside `launches()` — `StepRunner` opens it around the warm-up and the capture
of its graphs, after a device synchronization (so weights loaded earlier are settled) — on a GPU of
compute capability ≥ 9, where `request()` asked for it (a benchmark switch, benchmarks/decode_step.py --pdl;
off by default: on an H200 it shortened one-token forwards a little and nothing visible end to end;
docs/perf/gpu.md, session 6). Eager forwards
never use it. Kernels take a PDL constexpr (`flag`) and the launch options from `launch_options`
(Triton's `launch_pdl`).
"""

from __future__ import annotations

import contextlib

import torch

from redwood.kernels.triton_import import INTERPRET

_active = [False]


@contextlib.contextmanager
def launches(on: bool = True):
    """PDL launches for the kernels started inside (where `enabled` allows them)."""
    before = _active[0]
    _active[0] = bool(on)
    try:
        yield
    finally:
        _active[0] = before


def capturing() -> bool:
    """Whether kernels launched now belong to a captured step (inside `launches()`), PDL or not: other
    capture-only launch options (redwood.kernels.l2_prefetch) key on the same window."""
    return _active[0]


_requested = [False]


def request(on: bool = True) -> None:
    """Ask for (or stop asking for) PDL launches in captured steps: a benchmark switch (benchmarks/decode_step.py
    --pdl), read at each launch, so a benchmark can A/B in one process. Off by default."""
    _requested[0] = bool(on)


def requested() -> bool:
    """Whether `request()` asked for PDL launches."""
    return _requested[0]


def enabled(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` uses PDL: inside `launches()`, requested, on a CUDA
    device of compute capability ≥ 9, with a Triton that has the launch option; never in the
    interpreter."""
    if not _active[0] or INTERPRET or device.type != "cuda" or not requested():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and _triton_has_pdl()


def launch_options(on: bool) -> dict:
    """Extra keyword arguments for a kernel launch: Triton's `launch_pdl` when on, else none (older
    launchers and the interpreter do not take the option)."""
    return {"launch_pdl": True} if on else {}


_HAS_PDL: list[bool] = []


def _triton_has_pdl() -> bool:
    if not _HAS_PDL:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions

            _HAS_PDL.append("launch_pdl" in CUDAOptions.__dataclass_fields__)
        except Exception:  # no CUDA backend in this Triton
            _HAS_PDL.append(False)
    return _HAS_PDL[0]
