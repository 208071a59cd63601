"""Weights pulled into L2 ahead of the kernel that reads them, for captured one-token forwards.

At batch 1 most of a decoder layer's weight bytes are in the gate/up and down matrices, but the HBM is
busy only while those two kernels run: the q/k/v projection, attention and the o projection before them
read little and are bound by latency, a stretch of every layer in which the memory system idles (the
byte counts and times: docs/perf/megakernel.md, session 15). A persistent forward fusing every stage into
one kernel tried to remove those bubbles; this does it without
touching the kernels: once a layer's q/k/v kernel has run, a small kernel on a side stream asks the copy
engines (Hopper's `cp.async.bulk.prefetch.L2`, one instruction per 64 KB, PER_PROGRAM instructions per
program so that many SMs issue them, nothing loaded into registers) to bring the layer's o projection and
the first part of its gate/up matrix into L2, while attention runs. The gate/up kernel then finds that
part in L2 and reads only the rest from HBM.

It gains far less than the byte count predicted (docs/perf/megakernel.md, session 15): the skinny kernels
are bound by their programs' memory round trips, not by HBM bandwidth, so L2 hits shorten them little. The
prefetches are spread over many programs because a single issuing program made steps slower (one SM's copy
engine issues the prefetches slowly, and the side stream's chain of prefetch kernels became the critical
path).

Results are unchanged bit for bit: a prefetch is a hint (the kernels read the same values by the same
loads). Ordering: the side stream forks after the q/k/v kernel of each layer (so its prefetches queue
behind that kernel's loads, not in front of them) and joins the main stream at the end of the forward;
the prefetch kernel writes nothing.

How much of gate/up to bring in is `set_megabytes(MB)` (a benchmark switch: benchmarks/decode_step.py
--l2-prefetch; split evenly between the gate rows and the up rows, which each gate/up program reads in pairs;
0, the default, turns it off): H200's L2 holds 50 MB.
On only inside a captured step (`pdl.launches()`: `StepRunner` opens it around warm-up and capture), on a
GPU of compute capability ≥ 9, never in the interpreter, for one-token forwards through the skinny
kernels (batch-1 decoding and chain draft levels).
"""

from __future__ import annotations

import torch

from redwood.kernels import pdl
from redwood.kernels.triton_import import INTERPRET, jit, tl, triton

CHUNK = 1 << 16  # bytes per prefetch instruction
PER_PROGRAM = 16  # instructions per program: a region is spread over many SMs' copy engines
# Off by default: the best budget gained little (docs/perf/megakernel.md, session 15), and the whole GPU suite
# has not yet run with it on.
DEFAULT_MB = 0.0
_budget_mb = [DEFAULT_MB]


def set_megabytes(mb: float) -> None:
    """The prefetch budget in MB (0: off), read at each captured forward, so a benchmark can A/B in one
    process."""
    try:
        value = float(mb)
    except (TypeError, ValueError):
        raise ValueError(f"the L2 prefetch budget must be a number of megabytes, not {mb!r}") from None
    if not value >= 0:
        raise ValueError(f"the L2 prefetch budget must be ≥ 0 MB, not {mb!r}")
    _budget_mb[0] = value


def megabytes() -> float:
    """The prefetch budget in MB (`set_megabytes`; 0 by default)."""
    return _budget_mb[0]


def enabled(device: torch.device) -> bool:
    """Whether a captured forward on `device` prefetches: inside `pdl.launches()` (a captured step),
    a budget > 0 (`set_megabytes`), CUDA of compute capability ≥ 9 (the bulk prefetch instruction)."""
    if not pdl.capturing() or INTERPRET or triton is None or device.type != "cuda":
        return False
    return megabytes() > 0 and torch.cuda.get_device_capability(device)[0] >= 9


def regions(layer: dict[str, torch.Tensor], budget: int) -> list[tuple[int, int]]:
    """(address, bytes) to prefetch for one layer, in the order the kernels will read them: the whole o
    projection, then the first budget/2 bytes of the gate rows and of the up rows of `gate_up` [2F, K]
    (each capped at its half). Addresses and sizes are 16-byte multiples (the instruction's rule)."""
    out = [(layer["o"].data_ptr(), layer["o"].numel() * layer["o"].element_size())]
    gate_up = layer["gate_up"]
    half = gate_up.numel() * gate_up.element_size() // 2
    take = min(half, budget // 2) // 16 * 16
    if take:
        out += [(gate_up.data_ptr(), take), (gate_up.data_ptr() + half, take)]
    for addr, size in out:
        if addr % 16 or size % 16:
            raise ValueError(f"bulk L2 prefetch needs 16-byte aligned regions, got ({addr:#x}, {size})")
    return out


class LayerPrefetch:
    """The prefetch of every layer of one model for one captured forward: a side stream and, per layer,
    a device table of regions (addresses stay valid: weights do not move while a graph lives)."""

    def __init__(self, layers: list[dict[str, torch.Tensor]], budget: int, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.tables = []
        for layer in layers:
            rs = regions(layer, budget)
            self.tables.append(torch.tensor(rs, dtype=torch.int64, device=device))  # [R, 2]
        most = max(int(t[:, 1].max()) for t in self.tables)
        self.programs = max(1, -(-most // (CHUNK * PER_PROGRAM)))  # per region
        self.forked = False

    def issue(self, layer: int) -> None:
        """Fork the side stream from the current one and prefetch `layer`'s regions there."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        table = self.tables[layer]
        with torch.cuda.stream(self.stream):
            _prefetch_kernel[(table.shape[0], self.programs)](table, CHUNK=CHUNK, PER=PER_PROGRAM, num_warps=1)
        self.forked = True

    def join(self) -> None:
        """The current stream waits for the side stream (a capture must end with its streams joined)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


@jit
def _prefetch_kernel(TABLE, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Program (r, p): bytes [p·PER·CHUNK, (p+1)·PER·CHUNK) of region r of TABLE [R, 2] (address, bytes)
    into L2, CHUNK bytes per instruction."""
    r = tl.program_id(0)
    base = tl.load(TABLE + 2 * r)
    size = tl.load(TABLE + 2 * r + 1)
    offs = (tl.program_id(1) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    n = tl.minimum(size - offs, CHUNK)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, n.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
