"""Tile configs of the skinny-matmul kernels (redwood.kernels.gemv, redwood.kernels.qkv_rope): a table per
GPU model measured by benchmarks/gemv_bench.py (`gemv_configs/<GPU name>.json`), else a heuristic.

Table entries are keyed by (N, K, two weight-row streams per program — SiLU's gate/up or RoPE's rotation
pairs —, weight kind "float" | "int8", activation rows bucket 1 | 2 | 4 | … | 64). The table's `max_rows`
says how many tokens the model's skinny path takes on that GPU (1 unless 2-8-token forwards measured
faster through these kernels than through cuBLAS + the small fused kernels); its optional `tile_rows`
[lo, hi] adds a range of larger forwards (batched decoding: batch × tokens rows) that measured faster
through the tile kernel.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from redwood.kernels.triton_import import triton

CONFIG_DIR = Path(__file__).with_name("gemv_configs")  # tuned tile configs per GPU, by gemv_bench --write

Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)


def heuristic_config(N: int, K: int, silu: bool = False, int8: bool = False, rows: int = 1) -> Config:
    """A tile config for shapes the tuned table lacks. One row: enough programs to keep every SM
    streaming (few weight rows per program when N is small) and ~8K-element W tiles per iteration (twice
    the elements for int8 weights: the same bytes) — except int8 gate/up and LM-head-sized matrices, whose
    sweeps on the H200 (1.5B and 0.5B shapes) all chose 8-16 rows × 512 columns. 2-8 rows (the tensor-core
    tile kernel lost to cuBLAS there: docs/perf/gpu.md, session 5, attempt 9): the one-row config with
    BLOCK_N ≤ 8, which runs the CUDA-core rows kernel (unmeasured); tile configs (BLOCK_N ≥ 16) come only
    from a sweep's table — except for 9-64 rows, which only the tile kernel takes: 32 weight rows × 128
    columns per step, 3 stages."""
    if rows > 8:
        return 32, min(128, max(16, triton.next_power_of_2(K))), 4, 3
    if int8 and (silu or N > 16384) and N > 4096:
        block_n, block_k = (8 if silu else 16), min(512, max(16, triton.next_power_of_2(K)))
    else:
        block_k = min(2048 if int8 else 1024, max(16, triton.next_power_of_2(K)))
        block_n = 2 if N <= 4096 else (4 if silu or N <= 16384 else 8)
    return (min(block_n, 8) if rows > 1 else block_n), block_k, 4, 1


def rows_bucket(m: int) -> int:
    """Activation rows → the table's bucket: 1, 2, 4, 8, 16, 32 or 64."""
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _table(device_name: str) -> dict:
    path = CONFIG_DIR / (_file_stem(device_name) + ".json")
    return json.loads(path.read_text()) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def tuned_configs(device_name: str) -> dict[tuple[int, int, bool, str, int], Config]:
    """The table gemv_bench wrote for this GPU model: {(N, K, silu, weight kind, rows bucket): config},
    weight kind "int8" or "float" (16-bit; entries without one), rows bucket 1 / 2 / … / 64 (entries
    without one: 1); {} if there is none."""
    return {(e["N"], e["K"], e["silu"], e.get("weight", "float"), e.get("rows", 1)): tuple(e["config"])
            for e in _table(device_name).get("configs", [])}


def max_rows(device: torch.device | str) -> int:
    """How many activation rows the model's fused one-token path should take on this device: the tuned
    table's `max_rows` — where 2-8-row forwards measured faster through these kernels than through cuBLAS
    + the small fused kernels — else 1."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return int(_table(torch.cuda.get_device_name(device)).get("max_rows", 1))


def tile_rows(device: torch.device | str) -> tuple[int, int] | None:
    """The range of activation rows [lo, hi] (within 9-64) whose forwards the model's skinny path should
    take through the tile kernel on this device — the tuned table's `tile_rows`, where batched one-token
    forwards measured faster that way than through cuBLAS + the small fused kernels — else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    rng = _table(torch.cuda.get_device_name(device)).get("tile_rows")
    return (int(rng[0]), int(rng[1])) if rng else None


def _file_stem(device_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")


def config_for(N: int, K: int, silu: bool, device: torch.device, int8: bool = False, rows: int = 1) -> Config:
    bucket = rows_bucket(rows)
    if device.type == "cuda":
        key = (N, K, silu, "int8" if int8 else "float", bucket)
        tuned = tuned_configs(torch.cuda.get_device_name(device)).get(key)
        if tuned is not None:
            return tuned
    return heuristic_config(N, K, silu, int8, bucket)
