"""Build a Hugging Face transformers model holding exactly a redwood model's weights.

Used as the reference in tests (logits equality) and as the baseline in `redwood bench ar --compare-hf`:
the same tensors, whatever file format they came from, so any difference is the engine's.
"""

from __future__ import annotations

import torch

from redwood.config import ModelConfig
from redwood.models.transformer import Transformer


def to_hf_config(cfg: ModelConfig):
    import transformers

    rope: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type=s.rope_type, factor=s.factor)
        if s.rope_type == "llama3":
            rope.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        common["rope_parameters"] = rope
    else:
        common["rope_theta"] = rope.pop("rope_theta")
        common["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if cfg.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if cfg.arch == "mistral":
        return transformers.MistralConfig(sliding_window=cfg.sliding_window, **common)
    return transformers.LlamaConfig(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, **common)


def to_hf_model(model: Transformer):
    """A transformers CausalLM with `model`'s weights (copied), same dtype and device, in eval mode."""
    import transformers

    hf_config = to_hf_config(model.config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
    state = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()}
    if model.lm_head is None:
        state["lm_head.weight"] = model.embed_tokens.weight
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF model mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.config.rope_scaling is None and not torch.equal(
        model.rotary.inv_freq.cpu(), hf.model.rotary_emb.inv_freq.float().cpu()
    ):
        # A GGUF with baked-in rope factors: give HF the same frequencies.
        hf.model.rotary_emb.inv_freq.copy_(model.rotary.inv_freq)
        if hasattr(hf.model.rotary_emb, "original_inv_freq"):
            hf.model.rotary_emb.original_inv_freq = model.rotary.inv_freq.clone()
    return hf.to(model.device).eval()
