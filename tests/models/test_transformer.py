"""Our decoder's logits equal Hugging Face transformers' for the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from redwood.config import ModelConfig
from redwood.models.hf_compat import to_hf_model
from redwood.models.transformer import build_model
from tests.conftest import random_hf_model, tiny_hf_config

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "llama3.1-rope": ("llama", {"rope_parameters": {"rope_theta": 500000.0, **LLAMA31_ROPE}}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}}),
    "llama-head-dim": ("llama", {"head_dim": 32}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"sliding_window": 7}),
}


def ours_and_hf(name: str, seed: int = 0):
    arch, overrides = CASES[name]
    hf_config = tiny_hf_config(arch, **overrides)
    hf = random_hf_model(hf_config, seed=seed)
    cfg = ModelConfig.from_hf_dict(hf_config.to_dict())
    return build_model(cfg, hf.state_dict(), torch.float32, "cpu"), hf


def full_forward(model, ids: torch.Tensor) -> torch.Tensor:
    B, T = ids.shape
    cache = model.new_cache(B, T)
    return model(ids, torch.arange(T)[None].expand(B, -1), cache)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(name):
    model, hf = ours_and_hf(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    ours = full_forward(model, ids)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ref.abs().max() > 0.5  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-window", "llama3.1-rope"])
def test_incremental_decode_matches_full_forward(name):
    """Prefill 60 tokens, then chunks of 1 and 5: same logits as one forward over everything."""
    model, _ = ours_and_hf(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(2))
    ref = full_forward(model, ids)
    cache = model.new_cache(2, 80)
    outs, t = [], 0
    for n in [60, 1, 1, 5, 1, 5, 7]:
        pos = torch.arange(t, t + n)[None].expand(2, -1)
        outs.append(model(ids[:, t : t + n], pos, cache))
        cache.commit(n)
        t += n
    assert (torch.cat(outs, 1) - ref).abs().max().item() <= 1e-4


def test_sliding_window_changes_attention():
    """The window must actually hide old keys (else the mistral case above tests nothing)."""
    model, _ = ours_and_hf("mistral-window")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    windowed = full_forward(model, ids)
    object.__setattr__(model.config, "sliding_window", None)
    unwindowed = full_forward(model, ids)
    assert torch.allclose(windowed[:, :7], unwindowed[:, :7], atol=1e-5)
    assert (windowed[:, 10:] - unwindowed[:, 10:]).abs().max() > 1e-2


def test_logits_at_selects_positions():
    model, _ = ours_and_hf("qwen2")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = full_forward(model, ids)
    cache = model.new_cache(2, 12)
    picked = model(ids, torch.arange(12)[None].expand(2, -1), cache, logits_at=torch.tensor([[3], [11]]))
    assert torch.allclose(picked[0, 0], ref[0, 3], atol=1e-6) and torch.allclose(picked[1, 0], ref[1, 11], atol=1e-6)


def test_hf_compat_round_trip():
    """to_hf_model rebuilds an HF model with our weights (the bench/test reference)."""
    model, hf = ours_and_hf("llama3.1-rope")
    ids = torch.randint(0, model.config.vocab_size, (1, 30))
    with torch.no_grad():
        assert torch.allclose(to_hf_model(model)(ids).logits, hf(ids).logits, atol=1e-5)


@torch.inference_mode()
def test_fused_projections_give_the_same_logits_and_state(tiny_llm):
    """Fusing q/k/v and gate/up into one weight each changes neither the logits nor the state dict
    (the per-projection parameters become views of the fused weight: no copy)."""
    import copy

    from redwood.models.backends.cuda import fuse_projections

    model = copy.deepcopy(tiny_llm.model)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    pos = torch.arange(4)[None].expand(2, -1)
    before = model(ids, pos, model.new_cache(2, 8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)  # (the CUDA backend's weight transform; the CPU model keeps its plain layers)
    after = model(ids, pos, model.new_cache(2, 8))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    fused = model.state_dict()
    assert fused.keys() == state.keys() and all(torch.equal(fused[k], state[k]) for k in state)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr()


def test_the_fused_norm_and_rotation_keep_the_formulas_bits():
    """RMSNorm's float32 path (torch's rms_norm) and rope.rotate (q and k in one pass, in place) equal
    the written-out formulas bit for bit."""
    from redwood.models.rope import apply_rotary
    from redwood.models.transformer import RMSNorm

    g = torch.Generator().manual_seed(7)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=g) + 0.5
    for shape in ((1, 1, 96), (2, 5, 96), (3, 96)):
        x = torch.randn(*shape, generator=g) * 3
        ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
        assert torch.equal(norm(x), ref)
    x = torch.randn(2, 4, 3, 32, generator=g)  # [B, H, T, D]
    cos, sin = torch.randn(2, 3, 32, generator=g), torch.randn(2, 3, 32, generator=g)
    rotated = torch.cat((-x[..., 16:], x[..., :16]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), x * cos[:, None] + rotated * sin[:, None])
