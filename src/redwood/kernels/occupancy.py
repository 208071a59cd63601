"""How many programs of a compiled Triton kernel an SM holds at once (its occupancy), from the kernel's
registers and shared memory and the GPU's per-SM limits.

Split-KV attention sizes its grid to fill whole waves of the GPU (a last, partial wave costs about as
much as a full one), so it needs this number; guessing it per tile shape went wrong when a variant's
registers crossed a boundary (benchmarks/kernel_resources.py prints it per variant, no GPU needed).
"""

from __future__ import annotations

import functools

import torch

# sm_80 / sm_90 defaults where torch's device properties lack a field
_REGS_PER_SM = 65536
_SMEM_PER_SM = 233472  # 228 KB (sm_90; sm_80: 164 KB, which torch's properties report)
_THREADS_PER_SM = 2048
_BLOCKS_PER_SM = 32
_REG_GRANULE = 256  # registers are allocated per warp in units of 256
_SMEM_RESERVED = 1024  # shared memory the driver reserves per block (sm_80+)


def resident_programs(regs: int, shared: int, num_warps: int, *, regs_per_sm: int = _REGS_PER_SM,
                      smem_per_sm: int = _SMEM_PER_SM, threads_per_sm: int = _THREADS_PER_SM,
                      blocks_per_sm: int = _BLOCKS_PER_SM) -> int:
    """Blocks of `num_warps` warps using `regs` registers per thread and `shared` bytes of shared memory
    that fit on one SM at once (the smallest of the register, shared-memory, thread and block limits)."""
    per_warp = -(-regs * 32 // _REG_GRANULE) * _REG_GRANULE
    by_regs = regs_per_sm // max(1, per_warp * num_warps)
    by_smem = smem_per_sm // (shared + _SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, threads_per_sm // (32 * num_warps), blocks_per_sm))


@functools.lru_cache(maxsize=None)
def device_limits(device: torch.device) -> dict:
    """Per-SM registers, shared memory and threads of a CUDA device (torch's properties where it has
    them, else the sm_80 / sm_90 values)."""
    props = torch.cuda.get_device_properties(device)
    return dict(regs_per_sm=getattr(props, "regs_per_multiprocessor", _REGS_PER_SM),
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", _SMEM_PER_SM),
                threads_per_sm=getattr(props, "max_threads_per_multi_processor", _THREADS_PER_SM))


def compiled_occupancy(kernel, device: torch.device) -> int | None:
    """Resident programs per SM of a compiled Triton kernel (what `jit_fn.warmup(...)` returns), or None
    where this Triton does not tell its registers."""
    try:
        if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
            kernel._init_handles()  # loads the binary: ptxas's register count arrives with it
        regs, shared, warps = int(kernel.n_regs), int(kernel.metadata.shared), int(kernel.metadata.num_warps)
    except Exception:  # another Triton's compiled-kernel layout: the caller keeps its own estimate
        return None
    if regs <= 0:
        return None
    return resident_programs(regs, shared, warps, **device_limits(device)) or None
