"""Tensor parallelism's split, in one process: which heads, rows and columns each rank holds, the one-line errors
for shapes that cannot split, and loading a shard (safetensors, float GGUF) equals cutting the whole model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from redwood.config import ModelConfig
from redwood.errors import ConfigError
from redwood.loading import load_model
from redwood.models.shard import ShardPlan, check_shardable


def config(heads=8, kv=2, ffn=128, vocab=301) -> ModelConfig:
    return ModelConfig(
        arch="qwen2", vocab_size=vocab, hidden_size=64, intermediate_size=ffn, num_layers=1, num_heads=heads,
        num_kv_heads=kv, head_dim=8,
    )  # fmt: skip


def test_heads_split_and_kv_heads_replicate_below_the_rank_count():
    c = config(heads=8, kv=2)
    two = [ShardPlan(r, 2, c) for r in range(2)]
    assert [p.q_heads for p in two] == [(0, 4), (4, 4)]
    assert [p.kv_heads for p in two] == [(0, 1), (1, 1)]
    four = [ShardPlan(r, 4, c) for r in range(4)]  # 2 KV heads over 4 ranks: each on 2
    assert [p.kv_heads for p in four] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for p in four:  # every query head of a rank reads the rank's KV head (GQA: head h reads h // group)
        first, n = p.q_heads
        assert {h // c.group_size for h in range(first, first + n)} == {p.kv_heads[0]}
        assert (p.local_config.num_heads, p.local_config.num_kv_heads, p.local_config.intermediate_size) == (2, 1, 32)
    # the vocabulary in ⌈V/N⌉ rows a rank, the last one shorter
    assert [p.vocab for p in four] == [(0, 76), (76, 152), (152, 228), (228, 301)]
    assert four[0].vocab_rows == 76


@pytest.mark.parametrize(
    "world, kw, words",
    [
        (3, {}, "must divide the model's 8 attention heads"),
        (8, {"heads": 8, "kv": 4, "ffn": 100}, "must divide the MLP width 100"),
        (4, {"heads": 12, "kv": 6}, "one must divide the other"),
        (0, {}, "must be a positive integer"),
    ],
)
def test_shapes_that_cannot_split_are_one_line_errors(world, kw, words):
    with pytest.raises(ConfigError, match=words) as e:
        check_shardable(config(**kw), world)
    assert "\n" not in str(e.value)


@dataclass
class FakeGroup:
    """What loading reads of a group: the rank and the world (no collectives run)."""

    rank: int
    world: int


def _info(path):
    """The model at `path` with no tokenizer (the GGUF test files have none)."""
    from redwood.loading import ModelInfo, inspect_model
    from redwood.loading.gguf import read_gguf_config

    if path.is_dir():
        return inspect_model(path)
    return ModelInfo(config=read_gguf_config(path), tokenizer=None, source=str(path), path=path)


def _check_shards_equal_cuts(path, world=2):
    whole = load_model(_info(path), weights="float32").model.state_dict()
    for rank in range(world):
        shard = load_model(_info(path), tp=FakeGroup(rank, world)).model
        plan = ShardPlan(rank, world, shard.config)
        got = shard.state_dict()
        assert got.keys() == whole.keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, plan.take(name, whole[name])), name
        assert shard.kv_config.num_kv_heads == max(1, shard.config.num_kv_heads // world)


def test_a_safetensors_shard_is_the_cut_of_the_whole_model(tmp_path):
    from tests.conftest import random_hf_model, tiny_hf_config

    # (o_proj and MLP biases: the row-parallel biases live on rank 0 only; vocabulary 321: an uneven split)
    cfg = tiny_hf_config("llama", vocab_size=321, attention_bias=True, mlp_bias=True)
    random_hf_model(cfg).save_pretrained(tmp_path)
    _check_shards_equal_cuts(tmp_path)


def test_a_float_gguf_shard_is_the_cut_of_the_whole_model(tmp_path):
    from tests.loading.test_gguf import LLAMA_TYPES, random_state_dict, write_gguf

    # llama: Q/K rows permuted in the file, several quantized types (dequantized to float, then cut)
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama", random_state_dict(0, qkv_bias=False, tied=False), types=LLAMA_TYPES)
    _check_shards_equal_cuts(path)
    # qwen2: q/k/v biases, tied embeddings
    path = tmp_path / "tiny-qwen.gguf"
    write_gguf(path, "qwen2", random_state_dict(10, qkv_bias=True, tied=True))
    _check_shards_equal_cuts(path)


def test_packed_formats_refuse_tensor_parallelism(tmp_path):
    from tests.loading.test_gguf import random_state_dict, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2", random_state_dict(10, qkv_bias=True, tied=True))
    with pytest.raises(ConfigError, match="float weights") as e:
        load_model(_info(path), weights="int8", tp=FakeGroup(0, 2))
    assert "\n" not in str(e.value)
