"""bench.ar's decode-step floor: the bytes one step must read."""

from __future__ import annotations

import torch

from redwood.bench.ar import weight_bytes
from redwood.kernels import gemv
from redwood.loading import load_model


def test_weight_bytes_of_int8_copies_counts_them_not_the_model_dtype_projections(tiny_model_dir, monkeypatch):
    """A draft with quantize_skinny's int8 copies reads, in a one-token forward, each int8 projection and the int8
    head with their float32 row scales, plus the norms and q/k/v biases — not the model-dtype projections it keeps
    for longer forwards. (quantize_skinny needs CUDA; its layout is built here the way it builds it.)"""
    model = load_model(tiny_model_dir).model
    full = weight_bytes(model)
    layers = [
        {
            "qkv": gemv.quantize_int8(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
            "o": gemv.quantize_int8(a.o_proj.weight),
            "gate_up": gemv.quantize_int8(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
            "down": gemv.quantize_int8(m.down_proj.weight),
        }
        for a, m in ((layer.self_attn, layer.mlp) for layer in model.layers)
    ]
    monkeypatch.setattr(model, "skinny_int8", {"layers": layers, "lm_head": gemv.quantize_int8(model.head_weight)})
    cfg = model.config
    H, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    rows = L * (qkv_rows + H + 2 * F + H) + V  # every projection's and the head's output rows
    int8 = L * (qkv_rows * H + cfg.num_heads * cfg.head_dim * H + 2 * F * H + F * H) + V * H  # a byte a weight
    norms = (2 * L + 1) * H * 4  # float32 model: input / post-attention norms a layer, the final norm
    biases = L * qkv_rows * 4 if cfg.qkv_bias else 0
    assert weight_bytes(model) == int8 + 4 * rows + norms + biases
    assert weight_bytes(model) < 0.3 * full  # float32 projections: 4 bytes a weight


def test_decode_floor_reads_the_models_own_weights_and_kv_heads_a_tensor_parallel_rank_its_shard(tiny_model_dir):
    """The floor is what this model reads a step: under tensor parallelism a rank reads its weight shards and its
    KV heads (half of them at world 2), not the whole model's — the whole model's KV would double a rank's floor."""
    from redwood.bench.ar import decode_floor
    from tests.parallel.test_shard import FakeGroup

    whole = load_model(tiny_model_dir).model
    rank = load_model(tiny_model_dir, tp=FakeGroup(0, 2)).model
    c = whole.config
    assert c.num_kv_heads % 2 == 0  # the tiny model's KV heads split, not replicate
    slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # float32 K and V of one token, every layer
    for model, kv_share in ((whole, 1.0), (rank, 0.5)):
        floor = decode_floor(model, batch_size=3, prompt_len=10, gen_len=4, bandwidth=1e9)
        step = weight_bytes(model) + 3 * 12 * slot * kv_share  # mean context 10 + 4 / 2
        assert floor["step_bytes"] == step
        assert abs(floor["floor_step_ms"] - step / 1e9 * 1e3) < 1e-9
    assert weight_bytes(rank) < weight_bytes(whole)
