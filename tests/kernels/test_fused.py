"""The fused Triton kernels (redwood.kernels.fused) against the PyTorch code they replace.

References are the model's own code: RMSNorm, `F.silu(g) * u` (MLP), apply_rotary + RotaryEmbedding,
KVCache.write. Exactness required (bf16, fp16, fp32 inputs):
  * rope_and_write: bit-identical q, cache (slots not written are untouched) — everywhere;
  * add_rms_norm's residual sum: bit-identical;
  * silu_mul: bit-identical on CUDA (libdevice expf + IEEE division, as torch's CUDA silu); in the
    interpreter exp is numpy's, not CPU torch's (there fp32 ≤ 4 ulp, bf16/fp16 ≤ 2 ulp);
  * rms_norm: the float32 sum of squares runs in another order than torch's reduction, so the scale
    may differ in its last bit: ≤ 1 ulp of the normalized value (weight 1), ≤ 2 ulp after a weight
    in [0.5, 2) (bf16/fp16; both rare: < 0.1% of elements), ≤ 8 ulp for fp32.

Where they run:
  * on CUDA, in this process, when a GPU is there;
  * on the CPU through Triton's interpreter, in a child pytest run of this file with
    TRITON_INTERPRET=1 (`test_interpreter_suite`): triton reads the variable when kernels are
    decorated, so setting it here would not reach kernels already imported, and would leak into
    other tests.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tests.conftest import capture_cuda_graph, import_without_triton, run_in_triton_interpreter  # noqa: E402
from redwood.kernels import fused as fk  # noqa: E402
from redwood.kv.cache import KVCache  # noqa: E402
from redwood.models.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from redwood.models.transformer import RMSNorm  # noqa: E402

INTERPRET = fk._INTERPRET  # what the kernels were decorated under
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA device (the interpreter runs these in test_interpreter_suite)")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (same dtype; finite values)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    sign = 1 << (8 * a.element_size() - 1)

    def ordered(t):  # sign-magnitude bits → integers in the floats' order (±0 both 0)
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & (sign - 1)), i)

    return (ordered(a) - ordered(b)).abs()


def assert_ulps(out, ref, max_ulps: int, max_frac: float = 1.0):
    d = ulps(out.cpu(), ref.cpu())
    frac = (d > 0).double().mean().item()
    assert d.max().item() <= max_ulps and frac <= max_frac, \
        f"max {d.max().item()} ulp (allowed {max_ulps}), {frac:.2e} of elements differ (allowed {max_frac})"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------------------------------
# RMSNorm


NORM_SHAPES = [(3, 96), (2, 3, 192)] if INTERPRET else [(1, 1536), (7, 1536), (2, 5, 1536), (4, 3, 896)]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(dtype, shape):
    g = gen(1)
    H = shape[-1]
    x = randn(g, *shape, dtype=dtype, scale=3.0)
    ref_mod = RMSNorm(H, 1e-6).to(DEVICE, dtype)
    ones = ref_mod(x)
    if dtype == torch.float32:
        assert_ulps(fk.rms_norm(x, ref_mod.weight, 1e-6), ones, 8)
    else:
        assert_ulps(fk.rms_norm(x, ref_mod.weight, 1e-6), ones, 1, 1e-3)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.rand(H, generator=g) * 1.5 + 0.5)
    out = fk.rms_norm(x, ref_mod.weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        assert_ulps(out, ref_mod(x), 8)
    else:
        assert_ulps(out, ref_mod(x), 2, 1e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rms_norm(dtype, shape):
    g = gen(2)
    H = shape[-1]
    x = randn(g, *shape, dtype=dtype)
    residual = randn(g, *shape, dtype=dtype, scale=8.0)
    ref_mod = RMSNorm(H, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.rand(H, generator=g) * 1.5 + 0.5)
    normed, new_res = fk.add_rms_norm(x, residual, ref_mod.weight, 1e-5)
    ref_res = x + residual
    assert torch.equal(new_res, ref_res)
    if dtype == torch.float32:
        assert_ulps(normed, ref_mod(ref_res), 8)
    else:
        assert_ulps(normed, ref_mod(ref_res), 2, 1e-3)


@needs_kernel
def test_rms_norm_strided_rows_and_promoted_weight():
    g = gen(3)
    H = 96
    base = randn(g, 4, 2 * H, dtype=torch.bfloat16)
    x = base[:, :H]  # rows with a stride of 2H
    ref_mod = RMSNorm(H, 1e-6).to(DEVICE)  # float32 weight: torch promotes the product to float32
    with torch.no_grad():
        ref_mod.weight.copy_(torch.rand(H, generator=g) + 0.5)
    out = fk.rms_norm(x, ref_mod.weight, 1e-6)
    ref = ref_mod(x)
    assert out.dtype == torch.float32
    # the bf16 normalized value may differ by 1 bf16 ulp → up to ~2 bf16 ulps relative in fp32
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=0)


# ----------------------------------------------------------------------------------------------------
# SwiGLU


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 200), (2, 5, 72)] if INTERPRET else [(1, 1, 8960), (2, 5, 4864), (7, 1000)])
def test_silu_mul(dtype, shape):
    g = gen(4)
    *lead, Fd = shape
    gate_up = randn(g, *lead, 2 * Fd, dtype=dtype, scale=4.0)
    gate, up = gate_up[..., :Fd], gate_up[..., Fd:]
    ref = F.silu(gate) * up
    out = fk.silu_mul(gate_up, Fd)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    if not INTERPRET:
        assert torch.equal(out, ref)
    elif dtype == torch.float32:
        assert_ulps(out, ref, 4, 0.3)
    else:
        assert_ulps(out, ref, 2, 1e-2)
    assert torch.equal(fk.silu_mul(gate_up), out)  # F inferred


# ----------------------------------------------------------------------------------------------------
# RoPE + KV-cache write


def rope_case(dtype, B, T, Hq, Hkv, D, cap, seed):
    """Views of one fused QKV projection (non-contiguous), cos/sin from RotaryEmbedding, random
    caches, distinct random slots per row."""
    g = gen(seed)
    qkv = randn(g, B, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    cfg = types.SimpleNamespace(head_dim=D, rope_theta=1e6, rope_scaling=None)
    rotary = RotaryEmbedding(cfg).to(DEVICE)
    positions = torch.randint(0, 30000, (B, T), generator=g).to(DEVICE)
    cos, sin = rotary(positions, dtype)
    k_cache = randn(g, B, Hkv, cap, D, dtype=dtype)
    v_cache = randn(g, B, Hkv, cap, D, dtype=dtype)
    slots = torch.stack([torch.randperm(cap, generator=g)[:T] for _ in range(B)]).to(DEVICE)
    return q, k, v, cos, sin, k_cache, v_cache, slots


def rope_reference(q, k, v, cos, sin, k_cache, v_cache, slots):
    """Attention.forward's eager path: rotate [B, H, T, D] views, KVCache.write into copies."""
    q_rot = apply_rotary(q.transpose(1, 2), cos, sin)
    k_rot = apply_rotary(k.transpose(1, 2), cos, sin)
    kc, vc = k_cache.clone(), v_cache.clone()
    fake = types.SimpleNamespace(k=kc[None], v=vc[None], batch_size=q.shape[0])
    KVCache.write(fake, 0, slots, k_rot, v.transpose(1, 2))
    return q_rot, kc, vc


if INTERPRET:  # a few cases covering every value (the interpreter runs each program in Python)
    ROPE_CASES = [(1, 1, 12, 2, 128), (2, 1, 4, 4, 64), (1, 5, 12, 2, 64), (2, 5, 4, 4, 128)]
else:
    ROPE_CASES = [(B, T, Hq, Hkv, D) for B in (1, 3) for T in (1, 5) for Hq, Hkv in ((12, 2), (4, 4))
                  for D in (64, 128)]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", ROPE_CASES)
def test_rope_and_write(dtype, B, T, Hq, Hkv, D):
    args = rope_case(dtype, B, T, Hq, Hkv, D, cap=12, seed=5 + T + D)
    q_ref, kc_ref, vc_ref = rope_reference(*args)
    q, k, v, cos, sin, kc, vc, slots = args
    q_rot = fk.rope_and_write(q, k, v, cos, sin, kc, vc, slots)
    assert q_rot.shape == (B, Hq, T, D) and q_rot.dtype == dtype
    assert q_rot.transpose(1, 2).is_contiguous()
    assert torch.equal(q_rot, q_ref)
    assert torch.equal(kc, kc_ref)  # written slots rotated exactly, all others untouched
    assert torch.equal(vc, vc_ref)


@needs_kernel
def test_rope_and_write_contiguous_inputs_and_bad_slots():
    args = rope_case(torch.bfloat16, 2, 3, 4, 2, 64, cap=8, seed=11)
    q, k, v, cos, sin, kc, vc, slots = args
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_ref, kc_ref, vc_ref = rope_reference(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(fk.rope_and_write(q, k, v, cos, sin, kc, vc, slots), q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # slots outside [0, capacity) are skipped, never written out of bounds
    before_k, before_v = kc.clone(), vc.clone()
    bad = torch.tensor([[-1, 8, 9], [100, -5, 8]], device=DEVICE)
    assert torch.equal(fk.rope_and_write(q, k, v, cos, sin, kc, vc, bad), q_ref)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@needs_kernel
def test_rope_and_write_checks_shapes():
    q, k, v, cos, sin, kc, vc, slots = rope_case(torch.float32, 1, 2, 4, 2, 64, cap=4, seed=0)
    with pytest.raises(ValueError):
        fk.rope_and_write(q, k, v, cos[:, :1], sin, kc, vc, slots)
    with pytest.raises(TypeError):
        fk.rope_and_write(q, k, v, cos.half(), sin.half(), kc, vc, slots)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_cuda_graph_capture():
    dtype = torch.bfloat16
    q, k, v, cos, sin, kc, vc, slots = rope_case(dtype, 1, 1, 12, 2, 128, cap=16, seed=7)
    g = gen(8)
    x, res = randn(g, 1, 1, 1536, dtype=dtype), randn(g, 1, 1, 1536, dtype=dtype)
    w = randn(g, 1536, dtype=dtype)
    gate_up = randn(g, 1, 1, 2 * 8960, dtype=dtype)
    static = [q, k, v, cos, sin, slots, x, res, gate_up]

    def step():
        return (fk.rope_and_write(q, k, v, cos, sin, kc, vc, slots), *fk.add_rms_norm(x, res, w, 1e-6),
                fk.silu_mul(gate_up))

    graph, outs = capture_cuda_graph(step)
    fresh = rope_case(dtype, 1, 1, 12, 2, 128, cap=16, seed=9)
    for dst, src in zip(static, [*fresh[:5], fresh[7], randn(g, 1, 1, 1536, dtype=dtype),
                                 randn(g, 1, 1, 1536, dtype=dtype), randn(g, 1, 1, 2 * 8960, dtype=dtype)]):
        dst.copy_(src)
    kc0, vc0 = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    q_ref, kc_ref, vc_ref = rope_reference(q, k, v, cos, sin, kc0, vc0, slots)
    assert torch.equal(outs[0], q_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(outs[2], x + res)
    expect = fk.add_rms_norm(x, res, w, 1e-6)[0]
    assert torch.equal(outs[1], expect)
    assert torch.equal(outs[3], F.silu(gate_up[..., :8960]) * gate_up[..., 8960:])


# ----------------------------------------------------------------------------------------------------
# Availability, import without triton, the interpreter run


def test_available_and_import_without_triton(monkeypatch):
    assert not fk.available("cpu")
    if not INTERPRET:
        assert fk.available("cuda") == torch.cuda.is_available()
    else:
        assert fk.available("cpu", force_interpreter=True) and not fk.available("cuda")
    mod = import_without_triton(monkeypatch, fk)
    assert mod.triton is None
    assert not mod.available("cpu") and not mod.available("cuda")
    assert not mod.available("cpu", force_interpreter=True)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter child run")
def test_interpreter_suite():
    """Run this file's kernel cases on the CPU through Triton's interpreter, in a child pytest."""
    run_in_triton_interpreter(__file__)
