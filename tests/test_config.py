"""ModelConfig from HF config dicts, and its validation."""

from __future__ import annotations

import pytest

from redwood.config import ModelConfig
from redwood.errors import ConfigError, UnsupportedModelError
from tests.conftest import tiny_hf_config


def test_families_map_their_flags():
    q = ModelConfig.from_hf_dict(tiny_hf_config("qwen2").to_dict())
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None
    m = ModelConfig.from_hf_dict(tiny_hf_config("mistral", sliding_window=9).to_dict())
    assert m.sliding_window == 9 and not m.qkv_bias
    llama = ModelConfig.from_hf_dict(tiny_hf_config("llama", attention_bias=True, tie_word_embeddings=True).to_dict())
    assert (
        llama.qkv_bias and llama.o_bias and llama.tie_word_embeddings and llama.head_dim == 16 and llama.group_size == 2
    )


def test_transformers4_style_rope_fields():
    d = tiny_hf_config("llama").to_dict()
    d.pop("rope_parameters", None)
    d.update(
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"model_type": "gpt2"}, UnsupportedModelError, "gpt2"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, UnsupportedModelError, "yarn"),
        ({"num_key_value_heads": 3}, ConfigError, "multiple of num_kv_heads"),
        ({"hidden_size": 0}, ConfigError, "hidden_size"),
    ],
)
def test_bad_configs(change, error, match):
    d = tiny_hf_config("llama").to_dict()
    d.update(change)
    with pytest.raises(error, match=match):
        ModelConfig.from_hf_dict(d)


def test_qwen2_per_layer_sliding_window_rejected():
    d = tiny_hf_config("qwen2").to_dict()
    d.update(use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(d)


def test_speculation_depth_is_bounded_and_needs_a_draft_token():
    from redwood.speculation.config import MAX_DRAFT_DEPTH, SpeculativeConfig

    assert SpeculativeConfig(self_speculate=True, num_draft_tokens=MAX_DRAFT_DEPTH).make_tree().size == 65
    with pytest.raises(ConfigError, match="at most 64"):
        SpeculativeConfig(self_speculate=True, num_draft_tokens=MAX_DRAFT_DEPTH + 1)
    with pytest.raises(ConfigError, match="drafts 65 tokens deep; at most 64"):
        SpeculativeConfig(self_speculate=True, tree="chain:65")
    for empty in ("chain:0", "chains:4x0"):  # (as num_draft_tokens=0: vLLM also rejects 0 with a draft)
        with pytest.raises(ConfigError, match="no draft tokens"):
            SpeculativeConfig(self_speculate=True, tree=empty)
    with pytest.raises(ConfigError, match=">= 1"):
        SpeculativeConfig(self_speculate=True, num_draft_tokens=0)


def test_execution_config_is_validated_on_construction():
    from redwood.config import ExecutionConfig

    assert ExecutionConfig() == ExecutionConfig(attention="auto", kernels="auto", megakernel="auto")
    assert ExecutionConfig(skinny_tile_rows=[9, 64]).skinny_tile_rows == (9, 64)
    for bad, match in (
        (dict(attention="sdpa"), "attention='sdpa'"),
        (dict(kernels=True), "kernels=True"),
        (dict(megakernel="yes"), "megakernel='yes'"),
        (dict(cpu_fused="0"), "cpu_fused='0'"),
        (dict(skinny_rows=0), "skinny_rows=0"),
        (dict(skinny_tile_rows=(64, 9)), "skinny_tile_rows"),
        (dict(adaptive_threads=None), "adaptive_threads=None"),
    ):
        with pytest.raises(ConfigError, match=match):
            ExecutionConfig(**bad)


def test_only_envs_reads_redwood_settings_from_the_environment():
    """Every REDWOOD_ setting the library reads is in redwood.envs (nothing else reads os.environ for one)."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "redwood"
    pattern = re.compile(r"""(environ|getenv)[^\n]*REDWOOD_""")
    offenders = [
        str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "envs.py" and pattern.search(p.read_text())
    ]
    assert offenders == []
