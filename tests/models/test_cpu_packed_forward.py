"""The CPU packed-weights forward (backends.cpu_packed.packed_layer, PackedLinear.concat / raw): the same
logits as the plain layer forward, bit for bit — only the number of ops and kernel calls changes — for
int8, int4 and a file's mix of both (q | k as one int4 call, v int8), batch 1 and 2, decode, verify and
tree-masked forwards, dense and paged caches.

A tiny random Qwen2-style model whose projections are all 64-wide multiples (int4 concatenation needs
out_features % 64 == 0) on the CPU through torch's own packed-weight kernels.
"""

from __future__ import annotations

import pytest
import torch

from redwood.config import ModelConfig
from redwood.kv.cache import KVCache
from redwood.models import cpu_weights
from redwood.models.backends.cpu_packed import CpuPackedBackend
from redwood.models.cpu_weights import PackedLinear
from redwood.models.transformer import DecoderLayer, Transformer, build_model
from tests.conftest import random_hf_model, tiny_hf_config


def _tiny(kinds: str) -> Transformer:
    """kinds: "int8" / "int4" / "bfloat16" for every projection, or "mixed" (v_proj and down_proj int8 in layer 0, the
    rest int4: the layout of a Q4_K_M file, taken as "gguf")."""
    hf_config = tiny_hf_config(
        "qwen2", hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2
    )
    hf = random_hf_model(hf_config, seed=4, scale=0.08)
    model = build_model(ModelConfig.from_hf_dict(hf_config.to_dict()), hf.state_dict(), torch.float32, "cpu")
    if kinds != "mixed":
        model.quantize_cpu(kinds)
        return model
    for i, layer in enumerate(model.layers):  # packed as a GGUF file's loader packs them
        for m, name in ((layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            lin = getattr(m, name)
            setattr(m, name, PackedLinear(lin.weight, lin.bias, "int8" if (i, name) == (0, "v_proj") else "int4"))
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            setattr(
                layer.mlp, name, PackedLinear(lin.weight, lin.bias, "int8" if (i, name) == (0, "down_proj") else "int4")
            )
    model.quantize_cpu("gguf")
    return model


def _plain(model, monkeypatch):
    monkeypatch.setattr(CpuPackedBackend, "takes_packed", lambda self, model, x: False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_concat_equals_the_members_side_by_side(kind, bias):
    g = torch.Generator().manual_seed(0)
    members = [
        PackedLinear(torch.randn(n, 128, generator=g) * 0.05, torch.randn(n, generator=g) if bias else None, kind)
        for n in (192, 64, 64)
    ]
    x = torch.randn(17, 128, generator=g)
    xl = torch.randn(1, 130, 128, generator=g)  # a prefill chunk: the gemm paths
    before, before_gemm = [m(x) for m in members], [m(xl) for m in members]
    nbytes = sum(m.nbytes for m in members)
    assert cpu_weights.can_concat(members)
    whole = PackedLinear.concat(members)
    assert whole.out_features == 320 and whole.nbytes == nbytes
    assert sum(m.nbytes for m in members) == nbytes  # (the members now hold views of whole's buffers)
    for rows in (1, 4, 17):
        xb = x[:rows].to(torch.bfloat16)
        assert torch.equal(whole.raw(xb), torch.cat([m.raw(xb) for m in members], 1))
    assert torch.equal(whole(x), torch.cat(before, 1))
    for m, y, yl in zip(members, before, before_gemm):  # a member alone: its own weight (int4: strided scales)
        assert torch.equal(m(x), y) and torch.equal(m(xl), yl)


def test_can_concat_refuses_what_the_kernels_cannot_share():
    g = torch.Generator().manual_seed(1)
    w = lambda n, k=128: torch.randn(n, k, generator=g)  # noqa: E731
    assert not cpu_weights.can_concat([PackedLinear(w(64), None, "int4"), PackedLinear(w(64), None, "int8")])
    assert not cpu_weights.can_concat([PackedLinear(w(64), None, "int4"), PackedLinear(w(32), None, "int4")])
    assert not cpu_weights.can_concat([PackedLinear(w(64), None, "int8"), PackedLinear(w(64, 64), None, "int8")])
    assert not cpu_weights.can_concat([PackedLinear(w(64), None, "int8"), PackedLinear(w(64), w(64)[0], "int8")])
    assert not cpu_weights.can_concat([PackedLinear(w(64), None, "bfloat16")] * 2)
    assert cpu_weights.can_concat([PackedLinear(w(48), None, "int8"), PackedLinear(w(16), None, "int8")])


@pytest.mark.parametrize("kinds", ["int8", "int4", "bfloat16", "mixed"])
def test_packed_forward_equals_the_plain_forward_bit_for_bit(kinds, monkeypatch):
    """Prefill (40 tokens: under the gemm threshold, so the packed path), decode steps, a 4-token verify
    and a tree-masked forward at batch 2 — dense cache, and a paged one (two rows over shuffled pages)."""
    model = _tiny(kinds)
    attn = model.layers[0].self_attn
    groups = {"int8": 1, "int4": 1, "bfloat16": 3, "mixed": 2}[kinds]  # q | k | v, q | k and v, or each alone
    assert len(attn.cpu_qkv) == groups and len(model.layers[1].self_attn.cpu_qkv) == (3 if groups == 3 else 1)
    assert len(model.layers[0].mlp.cpu_gate_up) == (2 if kinds == "bfloat16" else 1)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 320, (2, 40), generator=g)
    steps = torch.randint(0, 320, (2, 7), generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)

    def paged():
        c = KVCache.paged(model.config, 2, 8, 16, 64, torch.float32, "cpu")
        c.block_table[:] = torch.tensor([[5, 1, 6, 0], [2, 7, 3, 4]], dtype=torch.int32)
        c.live[:] = 1
        return c

    def run(make_cache):
        cache, out = make_cache(), []
        with torch.inference_mode():
            out.append(model(prompt, torch.arange(40)[None].expand(2, -1), cache))
            cache.commit(40)
            for t in range(3):
                out.append(model(steps[:, t : t + 1], cache.lengths[:, None].clone(), cache))
                cache.commit(1)
            pos = cache.lengths[:, None] + torch.arange(4)
            out.append(model(steps[:, 3:7], pos, cache))
            out.append(model(steps[:, 3:7], cache.lengths[:, None] + torch.tensor([0, 1, 1, 2]), cache, new_mask=tree))
        return out

    for make_cache in (lambda: model.new_cache(2, 64), paged):
        with monkeypatch.context() as mp:  # (the packed path ran: the plain layer forward is not called)
            mp.setattr(DecoderLayer, "forward", lambda *a: pytest.fail("plain layer forward"))
            fast = run(make_cache)
        with monkeypatch.context() as mp:
            _plain(model, mp)
            plain = run(make_cache)
        assert all(torch.equal(a, b) for a, b in zip(fast, plain))
    assert fast[0].abs().max() > 0.5


def test_prefill_chunks_keep_the_plain_path():
    model = _tiny("int4")
    rows = min(cpu_weights.INT8_GEMM_ROWS, cpu_weights.INT4_GEMM_ROWS)
    assert model.backend.takes_packed(model, torch.zeros(1, rows - 1, 128))
    assert not model.backend.takes_packed(model, torch.zeros(1, rows, 128))
    assert model.backend.takes_packed(model, torch.zeros(40, 4, 128))  # a batch of verify steps: tokens per row count


def test_a_float_model_keeps_the_plain_path():
    hf_config = tiny_hf_config("qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = build_model(
        ModelConfig.from_hf_dict(hf_config.to_dict()), random_hf_model(hf_config).state_dict(), torch.float32, "cpu"
    )
    assert not isinstance(model.backend, CpuPackedBackend)  # a float model: the plain layers
    model.quantize_cpu("bfloat16")  # (bfloat16 projections do not concatenate, but take the packed path)
    assert model.backend.takes_packed(model, torch.zeros(1, 1, 128)) and len(model.layers[0].self_attn.cpu_qkv) == 3
