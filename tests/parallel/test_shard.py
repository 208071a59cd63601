"""Tensor parallelism's split, in one process: which heads, rows and columns each rank holds, the one-line errors
for shapes that cannot split, and loading a shard (safetensors, float GGUF) equals cutting the whole model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from redwood.config import ModelConfig
from redwood.engine.loaded import check_draft_tensor_parallel
from redwood.errors import ConfigError
from redwood.loading import ModelInfo, load_model
from redwood.models.cpu_weights import w8a8_exact
from redwood.models.shard import ShardPlan, check_shardable
from redwood.speculation.config import SpeculativeConfig


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


def draft_placed(placement) -> tuple[SpeculativeConfig, ModelInfo]:
    """A config placing an 8-head draft model (a float checkpoint: no file is read) by `placement`, and its info."""
    spec = SpeculativeConfig(draft_model="draft", draft_weights="float32", draft_tensor_parallel=placement)
    return spec, ModelInfo(config=config(heads=8, kv=2), tokenizer=None, source="draft", path=Path("draft"))


@pytest.mark.parametrize(
    "world, placement, words",
    [
        (4, 4, "draft_tensor_parallel 4 is every one of the 4 tensor-parallel ranks: that is draft_tensor_parallel="),
        (4, 8, "draft_tensor_parallel 8 is more ranks than tensor_parallel_size 4: a number K shards the draft model"),
        (
            8,
            3,
            "the draft model cannot be sharded over draft_tensor_parallel=3 ranks: tensor_parallel_size 3 must "
            "divide the model's 8 attention heads",
        ),
    ],
)
def test_a_draft_on_ranks_that_are_no_strict_subset_or_do_not_split_it_is_one_line(world, placement, words):
    spec, info = draft_placed(placement)
    with pytest.raises(ConfigError) as e:
        check_draft_tensor_parallel(spec, info, world, "cpu")
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("placement", [1, 2, 4, "shard", "replicate"])
def test_a_draft_on_a_strict_subset_that_splits_it_or_on_every_rank_passes(placement):
    check_draft_tensor_parallel(*draft_placed(placement), 8, "cpu")


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


# the kquant test file's types without its Q6_K o_proj (256 inputs: 128 a rank at TP=2, half a super-block), with a Q5_0
# o_proj in layer 1 (128 a rank: whole 32-value blocks)
def kq_types_that_shard() -> dict:
    from gguf import GGMLQuantizationType as QT

    from tests.models.test_cpu_kquant import KQ_TYPES

    return {
        **{k: v for k, v in KQ_TYPES.items() if k != "blk.0.attn_output.weight"},
        "blk.1.attn_output.weight": QT.Q5_0,
    }


def needs_kquant():
    from redwood.cpu_kernels import kquant

    if kquant.why_unavailable():
        pytest.skip(f"the kquant kernel cannot run here: {kquant.why_unavailable()}")


def test_a_kquant_shard_keeps_the_files_blocks_cut_on_their_boundaries(tmp_path):
    """Each rank's Q4_K / Q6_K / Q8_0 / Q5_0 projections are the file's own blocks, cut (rows anywhere; the
    row-parallel down_proj on whole 256-value blocks, a Q5_0 o_proj on whole 32-value ones): their values equal the cut of the file's, bit for bit; the other types
    take kquant's fallback, and the vocab-parallel head its rows."""
    needs_kquant()
    from redwood.cpu_kernels import kquant
    from redwood.loading.gguf import read_gguf
    from redwood.models.cpu_weights import KQUANT
    from tests.loading.test_gguf import gguf_name
    from tests.models.test_cpu_kquant import fallback, projections, write_mixed

    types = kq_types_that_shard()
    path = write_mixed(tmp_path / "kq.gguf", "qwen2", seed=6, types=types)
    whole = read_gguf(path).tensors  # the file's values as floats (HF names)
    hf = {gguf_name(k): k for k in whole}
    for rank in range(2):
        m = load_model(_info(path), weights="kquant", tp=FakeGroup(rank, 2)).model
        plan = ShardPlan(rank, 2, m.config)
        kinds = {}
        for g, module in projections(m):
            name = "lm_head.weight" if g == "output.weight" else hf[g]
            want = plan.take(name, whole[name])
            qtype = types.get(g)
            kinds[g] = module.kind
            if qtype is not None and qtype.name in kquant.TYPES:
                assert module.kind == KQUANT and module.type_name == qtype.name, g
                assert torch.equal(module.dequantized(), want), g  # the file's values, cut
            else:
                assert module.kind == fallback(), g
                assert torch.allclose(module.dequantized(), want, atol=want.abs().max().item() / 100), g
        assert kinds["blk.0.ffn_down.weight"] == KQUANT  # (row-parallel: 512 inputs, 256 a rank)
        assert kinds["blk.1.attn_output.weight"] == KQUANT  # (row-parallel Q5_0: 128 a rank, padded in the kernel)


def test_kquant_cut_inside_a_super_block_names_the_formats_that_shard(tmp_path):
    from tests.models.test_cpu_kquant import KQ_TYPES, write_mixed

    needs_kquant()
    path = write_mixed(tmp_path / "kq.gguf", "qwen2", seed=6, types=KQ_TYPES)
    with pytest.raises(ConfigError) as e:
        load_model(_info(path), weights="kquant", tp=FakeGroup(0, 2))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "weights='kquant' cannot be sharded over 2 ranks: model.layers.0.self_attn.o_proj.weight (Q6_K) splits "
        "its 256 inputs into 128 a rank, inside its 256-value super-blocks; formats that shard here: float32, "
    )
    fits = msg.split("shard here:")[1]
    assert "int8" in fits and "kquant" not in fits
    # (w8a8 only where fbgemm's int32 sums are exact — an AVX512-VNNI CPU; an AVX2 machine's list leaves it out)
    assert ("w8a8" in fits) == w8a8_exact()
    # auto takes the next format that shards instead (as it does for shapes a format cannot pack)
    assert load_model(_info(path), weights="auto", tp=FakeGroup(0, 2)).model.weights != "kquant"
    # and a file whose Q4_K / Q6_K row-parallel cuts fall on block boundaries keeps kquant under auto
    path = write_mixed(tmp_path / "kq-ok.gguf", "qwen2", seed=6, types=kq_types_that_shard())
    assert load_model(_info(path), weights="auto", tp=FakeGroup(1, 2)).model.weights == "kquant"
