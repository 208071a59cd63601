"""Resident programs per SM (redwood.kernels.occupancy): the register / shared-memory arithmetic that
sizes split-KV attention's grid, checked against hand-computed H100/H200 (sm_90) cases."""

from __future__ import annotations

import types

import torch

from redwood.kernels import occupancy


def test_registers_bound_in_warp_granules():
    # 106 registers → 3392 per warp, rounded up to 3584 → × 4 warps = 14336 → 4 blocks in 65536
    assert occupancy.resident_programs(106, 38912, 4) == 4
    # 177 → 5664 → 5888 per warp → 23552 per block → 2 (the 32-row attention tile on triton 3.9)
    assert occupancy.resident_programs(177, 45056, 4) == 2
    assert occupancy.resident_programs(168, 0, 4) == 3  # 168 × 32 = 5376 = 21 granules exactly
    assert occupancy.resident_programs(255, 0, 4) == 2


def test_shared_memory_and_thread_and_block_limits():
    # 112 KB + 1 KB reserved per block: 2 fit in 228 KB, 115 KB + 1 KB do not twice
    assert occupancy.resident_programs(64, 114688, 4) == 2
    assert occupancy.resident_programs(64, 118784, 4) == 1
    assert occupancy.resident_programs(32, 0, 32) == 2  # threads: 2048 / 1024
    assert occupancy.resident_programs(16, 0, 1) == 32  # blocks per SM cap
    assert occupancy.resident_programs(64, 300_000, 4) == 0  # does not fit at all


def test_compiled_occupancy_reads_the_kernel_or_gives_up(monkeypatch):
    dev = torch.device("cpu")
    limits = dict(regs_per_sm=65536, smem_per_sm=233472, threads_per_sm=2048)
    kernel = types.SimpleNamespace(n_regs=177, metadata=types.SimpleNamespace(shared=45056, num_warps=4))
    monkeypatch.setattr(occupancy, "device_limits", lambda device: limits)  # no CUDA properties here
    assert occupancy.compiled_occupancy(kernel, dev) == 2
    assert occupancy.compiled_occupancy(object(), dev) is None  # no register count: the caller estimates
    zero = types.SimpleNamespace(n_regs=0, metadata=kernel.metadata)
    assert occupancy.compiled_occupancy(zero, dev) is None
