"""engine.calibrate's long context: on a CPU LONG_CONTEXT; on a GPU the engine's longest up to LONG_CONTEXT_GPU,
as far as a share of the free device memory holds a one-row cache — a one-row forward over 1,024 slots reads too
few KV bytes on a GPU for its time to carry the per-slot cost (docs/perf/auto-policy.md item 20)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from redwood.config import ModelConfig
from redwood.engine import calibrate


def fake_model(device: str) -> SimpleNamespace:
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
    )
    slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # (Transformer.kv_slot_bytes, bf16)
    return SimpleNamespace(
        device=torch.device(device), kv_config=cfg, config=cfg, dtype=torch.bfloat16, kv_slot_bytes=slot
    )


def test_the_cpu_keeps_the_short_long_context():
    assert calibrate.long_context(fake_model("cpu"), 100_000) == calibrate.LONG_CONTEXT
    assert calibrate.long_context(fake_model("cpu"), 500) == 500


def test_a_gpu_calibrates_at_the_engines_longest_context_as_memory_allows(monkeypatch):
    slot = 2 * 28 * 2 * 128 * 2  # bytes of one slot's K and V over the layers (bf16): 28 KiB
    free = {"bytes": 80 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 << 30))
    gpu = fake_model("cuda")
    assert calibrate.long_context(gpu, 16_640) == 16_640  # the engine's longest
    assert calibrate.long_context(gpu, 1 << 20) == calibrate.LONG_CONTEXT_GPU  # capped
    free["bytes"] = 4 * slot * 8000  # a quarter of it holds 8,000 slots
    assert calibrate.long_context(gpu, 16_640) == 8000
    free["bytes"] = 0  # no room: never below the CPU's context (within the engine's)
    assert calibrate.long_context(gpu, 16_640) == calibrate.LONG_CONTEXT
    assert calibrate.long_context(gpu, 600) == 600
