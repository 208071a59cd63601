"""The fused Triton kernels (redwood.kernels.fused) against the PyTorch code they replace.

References are the model's own code: RMSNorm, `F.silu(g) * u` (MLP), apply_rotary + RotaryEmbedding,
and the cache write as an index_put at (page, offset), as KVCache.write does it. Exactness required
(bf16, fp16, fp32 inputs):
  * rope_and_write: bit-identical q, cache (slots not written are untouched) — everywhere, for a dense
    cache and a paged one (a random block table, page sizes 1, 3, 16; untouched pages bit-identical);
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

from redwood.kernels import fused as fk  # noqa: E402
from redwood.models.rope import RotaryEmbedding, apply_rotary  # noqa: E402
from redwood.models.transformer import RMSNorm  # noqa: E402
from tests.conftest import capture_cuda_graph, import_without_triton, run_in_triton_interpreter  # noqa: E402

INTERPRET = fk._INTERPRET  # what the kernels were decorated under
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA device (the interpreter runs these in test_interpreter_suite)"
)


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
    assert d.max().item() <= max_ulps and frac <= max_frac, (
        f"max {d.max().item()} ulp (allowed {max_ulps}), {frac:.2e} of elements differ (allowed {max_frac})"
    )


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
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)


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


def rope_case(dtype, B, T, Hq, Hkv, D, cap, seed, page_size=None):
    """Views of one fused QKV projection (non-contiguous), cos/sin from RotaryEmbedding, random caches,
    distinct random logical slots per row → their (pages, offsets).

    page_size None: a dense cache [B, Hkv, cap, D], pages = arange(B) expanded, offsets = the slots.
    Else a paged one [B · cdiv(cap, page_size) + 2, Hkv, page_size, D]: each row's logical pages at a
    random permutation of the physical ones (two pages belong to no row), pages/offsets through that
    table as KVCache.physical translates slots."""
    g = gen(seed)
    qkv = randn(g, B, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, Hq, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    cfg = types.SimpleNamespace(head_dim=D, rope_theta=1e6, rope_scaling=None)
    rotary = RotaryEmbedding(cfg).to(DEVICE)
    positions = torch.randint(0, 30000, (B, T), generator=g).to(DEVICE)
    cos, sin = rotary(positions, dtype)
    slots = torch.stack([torch.randperm(cap, generator=g)[:T] for _ in range(B)])
    if page_size is None:
        n_pages, page_size = B, cap
        pages = torch.arange(B)[:, None].expand(B, T)
        offsets = slots
    else:
        width = -(-cap // page_size)
        n_pages = B * width + 2
        table = torch.randperm(n_pages, generator=g)[: B * width].view(B, width)
        pages = table.gather(1, slots // page_size)
        offsets = slots % page_size
    k_cache = randn(g, n_pages, Hkv, page_size, D, dtype=dtype)
    v_cache = randn(g, n_pages, Hkv, page_size, D, dtype=dtype)
    return q, k, v, cos, sin, k_cache, v_cache, pages.to(DEVICE), offsets.to(DEVICE)


def rope_reference(q, k, v, cos, sin, k_cache, v_cache, pages, offsets):
    """Attention.forward's eager path: rotate [B, H, T, D] views, write (rotated k, v) into copies of the
    caches at (pages, offsets) as KVCache.write does (an index_put; destinations outside the cache are
    left out, as the kernel leaves them)."""
    q_rot = apply_rotary(q.transpose(1, 2), cos, sin)
    k_rot = apply_rotary(k.transpose(1, 2), cos, sin)
    kc, vc = k_cache.clone(), v_cache.clone()
    ok = (pages >= 0) & (pages < kc.shape[0]) & (offsets >= 0) & (offsets < kc.shape[2])
    # advanced indices around a slice put [N] first: values [N, Hkv, D]
    kc[pages[ok], :, offsets[ok]] = k_rot.transpose(1, 2)[ok]
    vc[pages[ok], :, offsets[ok]] = v[ok]
    return q_rot, kc, vc


def untouched(cache, before, pages, offsets):
    """Whether every (page, offset) of `cache` other than the destinations equals `before` bit for bit."""
    keep = torch.ones(cache.shape[0], cache.shape[2], dtype=torch.bool, device=cache.device)
    keep[pages.flatten(), offsets.flatten()] = False
    return torch.equal(cache.transpose(1, 2)[keep], before.transpose(1, 2)[keep])


if INTERPRET:  # a few cases covering every value (the interpreter runs each program in Python)
    ROPE_CASES = [(1, 1, 12, 2, 128), (2, 1, 4, 4, 64), (1, 5, 12, 2, 64), (2, 5, 4, 4, 128)]
else:
    ROPE_CASES = [
        (B, T, Hq, Hkv, D) for B in (1, 3) for T in (1, 5) for Hq, Hkv in ((12, 2), (4, 4)) for D in (64, 128)
    ]


@needs_kernel
@pytest.mark.parametrize("page_size", [None, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", ROPE_CASES)
def test_rope_and_write(dtype, B, T, Hq, Hkv, D, page_size):
    args = rope_case(dtype, B, T, Hq, Hkv, D, cap=12, seed=5 + T + D, page_size=page_size)
    q_ref, kc_ref, vc_ref = rope_reference(*args)
    q, k, v, cos, sin, kc, vc, pages, offsets = args
    kc0, vc0 = kc.clone(), vc.clone()
    q_rot = fk.rope_and_write(q, k, v, cos, sin, kc, vc, pages, offsets)
    assert q_rot.shape == (B, Hq, T, D) and q_rot.dtype == dtype
    assert q_rot.transpose(1, 2).is_contiguous()
    assert torch.equal(q_rot, q_ref)
    assert torch.equal(kc, kc_ref)  # written slots rotated exactly, all others untouched
    assert torch.equal(vc, vc_ref)
    assert untouched(kc, kc0, pages, offsets) and untouched(vc, vc0, pages, offsets)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_rope_and_write_paged_lands_in_the_right_page(page_size):
    """Rows' tokens through a random block table land at (table[b, s // ps], s % ps) and nowhere else:
    every other page, and every other offset of the written pages, is bit-identical afterwards."""
    B, T, Hq, Hkv, D = 3, 4, 4, 2, 64
    args = rope_case(torch.bfloat16, B, T, Hq, Hkv, D, cap=20, seed=30 + page_size, page_size=page_size)
    q, k, v, cos, sin, kc, vc, pages, offsets = args
    q_ref, kc_ref, vc_ref = rope_reference(*args)
    kc0, vc0 = kc.clone(), vc.clone()
    assert torch.equal(fk.rope_and_write(q, k, v, cos, sin, kc, vc, pages, offsets), q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert untouched(kc, kc0, pages, offsets) and untouched(vc, vc0, pages, offsets)
    written = torch.zeros(kc.shape[0], dtype=torch.bool, device=kc.device)
    written[pages.flatten()] = True
    assert torch.equal(kc[~written], kc0[~written]) and torch.equal(vc[~written], vc0[~written])
    k_rot = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
    for b in range(B):
        for t in range(T):
            assert torch.equal(kc[pages[b, t], :, offsets[b, t]], k_rot[b, :, t])
            assert torch.equal(vc[pages[b, t], :, offsets[b, t]], v[b, t])


@needs_kernel
@pytest.mark.parametrize("page_size", [None, 4])
def test_rope_and_write_contiguous_inputs_and_bad_destinations(page_size):
    args = rope_case(torch.bfloat16, 2, 3, 4, 2, 64, cap=8, seed=11, page_size=page_size)
    q, k, v, cos, sin, kc, vc, pages, offsets = args
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_ref, kc_ref, vc_ref = rope_reference(q, k, v, cos, sin, kc, vc, pages, offsets)
    assert torch.equal(fk.rope_and_write(q, k, v, cos, sin, kc, vc, pages, offsets), q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # pages outside [0, P) or offsets outside [0, page_size) are skipped, never written out of bounds
    before_k, before_v = kc.clone(), vc.clone()
    P, ps = kc.shape[0], kc.shape[2]
    bad_pages = torch.tensor([[-1, P, 0], [P + 5, 1, -3]], device=DEVICE)
    bad_offsets = torch.tensor([[0, 1, ps], [2, -1, 100]], device=DEVICE)
    assert torch.equal(fk.rope_and_write(q, k, v, cos, sin, kc, vc, bad_pages, bad_offsets), q_ref)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@needs_kernel
def test_rope_and_write_checks_shapes():
    q, k, v, cos, sin, kc, vc, pages, offsets = rope_case(torch.float32, 1, 2, 4, 2, 64, cap=4, seed=0)
    with pytest.raises(ValueError):
        fk.rope_and_write(q, k, v, cos[:, :1], sin, kc, vc, pages, offsets)
    with pytest.raises(ValueError):
        fk.rope_and_write(q, k, v, cos, sin, kc, vc, pages, offsets[:, :1])
    with pytest.raises(ValueError):
        fk.rope_and_write(q, k, v, cos, sin, kc[:, :1], vc[:, :1], pages, offsets)  # Hkv mismatch
    with pytest.raises(TypeError):
        fk.rope_and_write(q, k, v, cos.half(), sin.half(), kc, vc, pages, offsets)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_cuda_graph_capture():
    dtype = torch.bfloat16
    q, k, v, cos, sin, kc, vc, pages, offsets = rope_case(dtype, 1, 1, 12, 2, 128, cap=64, seed=7, page_size=16)
    g = gen(8)
    x, res = randn(g, 1, 1, 1536, dtype=dtype), randn(g, 1, 1, 1536, dtype=dtype)
    w = randn(g, 1536, dtype=dtype)
    gate_up = randn(g, 1, 1, 2 * 8960, dtype=dtype)
    static = [q, k, v, cos, sin, pages, offsets, x, res, gate_up]

    def step():
        return (
            fk.rope_and_write(q, k, v, cos, sin, kc, vc, pages, offsets),
            *fk.add_rms_norm(x, res, w, 1e-6),
            fk.silu_mul(gate_up),
        )

    graph, outs = capture_cuda_graph(step)
    fresh = rope_case(dtype, 1, 1, 12, 2, 128, cap=64, seed=9, page_size=16)  # another page and offset
    for dst, src in zip(
        static,
        [
            *fresh[:5],
            *fresh[7:],
            randn(g, 1, 1, 1536, dtype=dtype),
            randn(g, 1, 1, 1536, dtype=dtype),
            randn(g, 1, 1, 2 * 8960, dtype=dtype),
        ],
    ):
        dst.copy_(src)
    kc0, vc0 = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    q_ref, kc_ref, vc_ref = rope_reference(q, k, v, cos, sin, kc0, vc0, pages, offsets)
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
