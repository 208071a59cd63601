"""The one-token L2 prefetch (redwood.kernels.l2_prefetch): which regions it asks for, when it is on, and
that a captured forward with it computes exactly what it computes without it.

The GPU check replays graphed one-token forwards of a random bf16 model (bf16 and int8 skinny weights)
with and without the prefetch and compares logits and the KV cache bit for bit: the prefetch kernel runs
on a forked side stream, so a missing fork / join or a kernel that wrote anything would show. It needs
compute capability ≥ 9 (the bulk prefetch instruction); elsewhere only the CPU checks run.
"""

from __future__ import annotations

import pytest
import torch

from redwood.kernels import l2_prefetch, pdl
from tests.conftest import decode_tokens


def _layer(o_shape, gu_shape, dtype=torch.bfloat16):
    return {"o": torch.zeros(o_shape, dtype=dtype), "gate_up": torch.zeros(gu_shape, dtype=dtype)}


def test_regions_are_o_then_the_first_part_of_gate_and_of_up():
    layer = _layer((64, 32), (2 * 96, 32))  # o 4 KiB; gate and up 6 KiB each
    o, gu = layer["o"], layer["gate_up"]
    half = 96 * 32 * 2
    assert l2_prefetch.regions(layer, 2048) == [
        (o.data_ptr(), 4096),
        (gu.data_ptr(), 1024),
        (gu.data_ptr() + half, 1024),
    ]
    # a budget beyond the matrix takes each half whole, never past it
    assert l2_prefetch.regions(layer, 10**9)[1:] == [(gu.data_ptr(), half), (gu.data_ptr() + half, half)]
    assert l2_prefetch.regions(layer, 0) == [(o.data_ptr(), 4096)]  # o only
    assert l2_prefetch.regions(layer, 100)[1][1] == 48  # rounded down to 16 bytes (50 → 48)
    int8 = _layer((64, 32), (2 * 96, 32), torch.int8)
    assert l2_prefetch.regions(int8, 10**9)[1][1] == 96 * 32  # bytes, not elements


def test_regions_reject_unaligned_weights():
    base = torch.zeros(2 * 96 * 32 + 1, dtype=torch.int8)
    layer = {"o": torch.zeros(64, 32, dtype=torch.int8), "gate_up": base[1:].view(2 * 96, 32)}
    with pytest.raises(ValueError, match="16-byte aligned"):
        l2_prefetch.regions(layer, 4096)


def test_budget_is_set_by_the_benchmark_switch(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "_budget_mb", [l2_prefetch.DEFAULT_MB])
    assert l2_prefetch.megabytes() == 0  # off by default
    l2_prefetch.set_megabytes("24.5")
    assert l2_prefetch.megabytes() == 24.5
    for bad in ("lots", "-1", "nan", -1.0):
        with pytest.raises(ValueError, match="L2 prefetch budget"):
            l2_prefetch.set_megabytes(bad)
    assert l2_prefetch.megabytes() == 24.5  # (a bad value changes nothing)


def test_off_outside_a_captured_step_and_on_the_cpu(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "_budget_mb", [32.0])
    assert not l2_prefetch.enabled(torch.device("cpu"))
    with pdl.launches():
        assert pdl.capturing()
        assert not l2_prefetch.enabled(torch.device("cpu"))
    assert not pdl.capturing()
    if torch.cuda.is_available():
        assert not l2_prefetch.enabled(torch.device("cuda"))  # not inside a captured step


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the bulk L2 prefetch needs a GPU of compute capability >= 9",
)


@hopper
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("use_pdl", ["0", "1"])
def test_graphed_forwards_with_prefetch_equal_those_without(int8, use_pdl, monkeypatch):
    from redwood.config import ExecutionConfig, ModelConfig
    from redwood.engine.runner import StepRunner
    from redwood.models.transformer import Transformer, build_model

    monkeypatch.setattr(pdl, "_requested", [use_pdl == "1"])
    monkeypatch.setattr(l2_prefetch, "_budget_mb", [l2_prefetch.DEFAULT_MB])
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 4096,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
        }
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {k: torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05 for k, s in shapes.items()}
    model = build_model(cfg, state, torch.bfloat16, "cuda")
    # the prefetch rides the skinny path's one-token forwards (which the megakernel replaces)
    model.set_execution(ExecutionConfig(megakernel="off"))
    assert model.backend.skinny
    if int8:
        model.quantize_skinny("int8")
    ids = torch.randint(0, cfg.vocab_size, (1, 8), device="cuda", generator=g)

    def run(mb: str):  # (set_megabytes: the budget, restored to 0 after the test by the monkeypatch above)
        l2_prefetch.set_megabytes(mb)
        cache = model.new_cache(1, 256)
        cache.lengths.fill_(100)
        return decode_tokens(StepRunner(model, cache, use_graphs=True), cache, ids)

    expected = run("0")
    assert not model.backend._prefetch_plans
    got = run("1")  # 1 MiB: o and part of each layer's gate/up
    assert list(model.backend._prefetch_plans) == [(2**20, int8)]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
