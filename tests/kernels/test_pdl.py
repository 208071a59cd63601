"""Programmatic dependent launch (redwood.kernels.pdl): when it is on, and that kernels launched with it
compute exactly what they compute without it.

The GPU check is a captured chain of dependent kernels (each reads what the previous one wrote, the
kernels that start early read their first weight tile before waiting), replayed and compared bit for
bit with the same chain run eagerly without PDL: a kernel that read its input before the previous one
finished would show as a difference. It needs compute capability ≥ 9 (H100/H200); elsewhere PDL is off
and only the switch logic below runs.
"""

from __future__ import annotations

import pytest
import torch

from redwood.kernels import pdl


def test_off_unless_requested_inside_a_capture_scope_on_a_hopper_gpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(pdl, "_requested", [True])
    assert pdl.requested()
    assert not pdl.enabled(cpu)  # not inside launches()
    with pdl.launches():
        assert not pdl.enabled(cpu)  # not a CUDA device
        with pdl.launches(False):
            assert not pdl._active[0]
        assert pdl._active[0]  # restored after a nested scope
    assert not pdl._active[0]
    pdl.request(False)
    assert not pdl.requested()
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


def test_scope_is_restored_after_an_error():
    with pytest.raises(RuntimeError):
        with pdl.launches():
            raise RuntimeError("boom")
    assert not pdl._active[0]


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs a GPU of compute capability >= 9",
)


@hopper
@pytest.mark.parametrize("int8", [False, True])
def test_pdl_chain_in_a_graph_equals_eager_without_pdl(int8, monkeypatch):
    """A 1.5B-shaped layer (norm-folded q/k/v + RoPE + cache write, attention, o with the residual,
    gate/up with the norm and SiLU, down with the residual) three times, plus a 4-row product, captured
    with PDL launches: every replay == the eager chain without PDL, bit for bit."""
    from redwood.attention.triton_decode import decode_attention
    from redwood.kernels import gemv, qkv_rope
    from tests.conftest import capture_cuda_graph

    monkeypatch.setattr(pdl, "_requested", [True])
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, F, Hq, Hkv, D, cap = 1536, 8960, 12, 2, 128, 512

    def w(n, k):
        m = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * k**-0.5
        return gemv.quantize_int8(m) if int8 else (m.to(dt), None)

    Wqkv, Wo, Wgu, Wd = w((Hq + 2 * Hkv) * D, H), w(H, Hq * D), w(2 * F, H), w(H, F)
    bqkv = torch.randn((Hq + 2 * Hkv) * D, device=dev, generator=g).to(dt)
    g1 = (torch.rand(H, device=dev, generator=g) + 0.5).to(dt)
    g2 = (torch.rand(H, device=dev, generator=g) + 0.5).to(dt)
    cos = torch.rand(1, 1, D, device=dev, generator=g).to(dt)
    sin = torch.rand(1, 1, D, device=dev, generator=g).to(dt)
    x0 = torch.randn(1, 1, H, device=dev, generator=g).to(dt)
    k0 = torch.randn(1, Hkv, cap, D, device=dev, generator=g).to(dt)
    v0 = torch.randn(1, Hkv, cap, D, device=dev, generator=g).to(dt)
    rows = torch.randn(4, H, device=dev, generator=g).to(dt)
    lengths = torch.tensor([300], device=dev, dtype=torch.int32)
    pages, offsets = torch.zeros(1, 1, dtype=torch.long, device=dev), torch.tensor([[300]], device=dev)
    x, kc, vc = x0.clone(), k0.clone(), v0.clone()

    def chain():
        for _ in range(3):
            q = qkv_rope.qkv_rope_write(
                x,
                Wqkv[0],
                bqkv,
                scale=Wqkv[1],
                norm=(g1, 1e-6),
                cos=cos,
                sin=sin,
                k_cache=kc,
                v_cache=vc,
                pages=pages,
                offsets=offsets,
                num_heads=Hq,
            )
            att = decode_attention(q, kc, vc, lengths).reshape(1, 1, Hq * D)
            gemv.linear(att, Wo[0], scale=Wo[1], residual=x)
            act = gemv.linear(x, Wgu[0], scale=Wgu[1], norm=(g2, 1e-6), silu_mul=True)
            gemv.linear(act, Wd[0], scale=Wd[1], residual=x)
        return x.clone(), gemv.linear(rows + x[0], Wo[0], scale=Wo[1], norm=(g1, 1e-6))  # 4 rows

    expected = chain()  # eager, outside launches(): no PDL
    kc_ref, vc_ref = kc.clone(), vc.clone()
    with pdl.launches():
        assert pdl.enabled(dev)
        x.copy_(x0), kc.copy_(k0), vc.copy_(v0)
        graph, outs = capture_cuda_graph(chain)
    for _ in range(3):
        x.copy_(x0), kc.copy_(k0), vc.copy_(v0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], expected[0]) and torch.equal(outs[1], expected[1])
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
