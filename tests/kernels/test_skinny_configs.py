"""Tile configs of the skinny kernels (redwood.kernels.skinny_configs): the committed table, the heuristic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from redwood.kernels import skinny_configs  # noqa: E402


def test_tile_configs_from_the_table_else_the_heuristic():
    """The committed table is read by GPU name; shapes it lacks get the heuristic; every config is a
    (BLOCK_N, BLOCK_K, num_warps, num_stages) of powers of two."""
    table = skinny_configs.tuned_configs("NVIDIA H200")
    assert (2048, 1536, False, "float", 1) in table and (8960, 1536, True, "float", 1) in table  # 1.5B qkv, gate/up
    assert skinny_configs.tuned_configs("no such GPU") == {}
    assert skinny_configs._file_stem("NVIDIA H200 NVL") == "NVIDIA_H200_NVL"
    for cfg in [
        *table.values(),
        skinny_configs.heuristic_config(5, 3),
        skinny_configs.heuristic_config(100_000, 8192, True),
        skinny_configs.heuristic_config(896, 4864, int8=True),
    ]:
        assert len(cfg) == 4 and all(v > 0 and v & (v - 1) == 0 for v in cfg[:3]) and cfg[3] >= 1
    assert skinny_configs.config_for(2048, 1536, False, torch.device("cpu")) == skinny_configs.heuristic_config(
        2048, 1536
    )
    assert skinny_configs.config_for(2048, 1536, False, torch.device("cpu"), rows=3) == skinny_configs.heuristic_config(
        2048, 1536, rows=4
    )
    # 2-8 rows: the CUDA-core rows kernel (BLOCK_N < 16; the tile kernel only from a tuned table)
    assert all(skinny_configs.heuristic_config(n, 1536, rows=4, int8=q)[0] < 16 for n in (2048, 151936) for q in (0, 1))
    assert [skinny_configs.rows_bucket(m) for m in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert skinny_configs.max_rows("cpu") == 1 and skinny_configs.tile_rows("cpu") is None
    # 9-64 rows: only the tile kernel takes them (BLOCK_N ≥ 16), pipelined
    for n, k, silu in [(2048, 1536, False), (8960, 1536, True), (3, 20, False)]:
        bn, bk, _, stages = skinny_configs.heuristic_config(n, k, silu, rows=64)
        assert bn >= 16 and bk <= max(16, k * 2) and stages > 1


def test_int8_heuristic_agrees_with_the_h200_sweeps_on_the_large_matrices():
    """The int8 rule for gate/up and LM-head-sized matrices is what the committed int8 sweeps chose."""
    table = skinny_configs.tuned_configs("NVIDIA H200")
    for N, K, silu in [(151936, 896, False), (151936, 1536, False), (4864, 896, True), (8960, 1536, True)]:
        tuned = table[(N, K, silu, "int8", 1)]
        assert skinny_configs.heuristic_config(N, K, silu, int8=True)[:2] == tuned[:2]
