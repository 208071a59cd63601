"""One token's q/k/v projection with RoPE and the K/V cache write in one kernel (redwood.kernels.qkv_rope)
against the two kernels it replaces: gemv.linear (norm folded in, bias) then fused.rope_and_write.

Runs on CUDA in this process when a GPU is there; on the CPU through Triton's interpreter in a child
pytest of this file (`test_interpreter_suite`).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from redwood.kernels import gemv, qkv_rope  # noqa: E402
from tests.conftest import interpreter_broken, run_in_triton_interpreter  # noqa: E402
from tests.kernels.test_fused import DEVICE, DTYPES, INTERPRET, gen, needs_kernel, randn  # noqa: E402
from tests.kernels.test_gemv import ULP  # noqa: E402

if INTERPRET and (why := interpreter_broken()):  # the K loop's bound is a kernel argument
    pytest.skip(why, allow_module_level=True)


def rope_case(dtype, Hq, Hkv, D, H, cap, seed, int8=False, num_pages=1):
    from redwood.config import ModelConfig
    from redwood.models.rope import RotaryEmbedding

    g = gen(seed)
    x = randn(g, 1, 1, H, dtype=dtype, scale=2.0)
    w = randn(g, (Hq + 2 * Hkv) * D, H, dtype=dtype, scale=H**-0.5)
    b = randn(g, (Hq + 2 * Hkv) * D, dtype=dtype)
    nw = randn(g, H, dtype=dtype)
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "vocab_size": 8,
            "hidden_size": Hq * D,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": Hq,
            "num_key_value_heads": Hkv,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
        }
    )
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(torch.tensor([[cap // 2 + 3]], device=DEVICE), dtype)
    kc = randn(g, num_pages, Hkv, cap, D, dtype=dtype)  # [P, Hkv, page_size = cap, D]
    vc = randn(g, num_pages, Hkv, cap, D, dtype=dtype)
    q8 = gemv.quantize_int8(w) if int8 else (w, None)
    return x, q8, b, nw, cos, sin, kc, vc


# (physical pages, page size, the token's page, its offset): a dense one-row cache (page 0, offset =
# the slot), and a paged one whose page is neither the first nor the last
LAYOUTS = [(1, 12, 0, 7), (5, 3, 3, 2)]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "Hq,Hkv,D,H", [(4, 2, 16, 48), (3, 1, 8, 40)] if INTERPRET else [(12, 2, 128, 1536), (14, 2, 64, 896)]
)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("num_pages,page_size,page,offset", LAYOUTS)
def test_qkv_rope_write_equals_linear_then_rope_and_write(
    dtype, Hq, Hkv, D, H, int8, num_pages, page_size, page, offset
):
    """One kernel == gemv.linear (norm folded, bias) followed by fused.rope_and_write, same tile config:
    the same sums, rounded and rotated the same way (bit for bit in the interpreter, within an ulp
    compiled); only the token's (page, offset) is written, every other slot of every page is
    bit-identical."""
    from redwood.kernels import fused

    x, (w, scale), b, nw, cos, sin, kc, vc = rope_case(
        dtype, Hq, Hkv, D, H, page_size, seed=50 + Hq, int8=int8, num_pages=num_pages
    )
    pages, offsets = torch.tensor([[page]], device=DEVICE), torch.tensor([[offset]], device=DEVICE)
    cfg = (2, 64 if INTERPRET else 1024, 4, 1)
    kc0, vc0 = kc.clone(), vc.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_rope.qkv_rope_write(
        x,
        w,
        b,
        scale=scale,
        norm=(nw, 1e-6),
        cos=cos,
        sin=sin,
        k_cache=kc,
        v_cache=vc,
        pages=pages,
        offsets=offsets,
        num_heads=Hq,
        config=cfg,
    )
    qkv = gemv.linear(x, w, b, scale=scale, norm=(nw, 1e-6), config=cfg)
    nq, nk = Hq * D, Hkv * D
    shape = (1, 1, -1, D)
    q_ref = fused.rope_and_write(
        qkv[..., :nq].reshape(shape),
        qkv[..., nq : nq + nk].reshape(shape),
        qkv[..., nq + nk :].reshape(shape),
        cos,
        sin,
        kc2,
        vc2,
        pages,
        offsets,
    )
    assert q.shape == (1, Hq, 1, D)
    keep = torch.ones(num_pages, page_size, dtype=torch.bool, device=kc.device)
    keep[page, offset] = False
    for got, before in ((kc, kc0), (vc, vc0)):
        assert torch.equal(got.transpose(1, 2)[keep], before.transpose(1, 2)[keep])
        assert not torch.equal(got[page, :, offset], before[page, :, offset])
    if INTERPRET:  # numpy sums in one order: the same bits
        assert torch.equal(q, q_ref) and torch.equal(kc, kc2)
    else:  # compiled reductions sum in a layout-dependent order: a projection may land one ulp away,
        # which the rotation carries (x1·c − x2·s: up to an ulp of the head's largest value)
        for got, ref in ((q, q_ref), (kc, kc2), (vc, vc2)):
            tol = 2 * ULP[dtype] * ref.abs().amax(-1, keepdim=True)
            assert ((got.float() - ref.float()).abs() <= tol).all()  # measured: 15-25% of values differ
    if INTERPRET:
        assert torch.equal(vc, vc2)


@needs_kernel
def test_qkv_rope_write_skips_destinations_outside_the_cache_and_checks_shapes():
    x, (w, _), b, nw, cos, sin, kc, vc = rope_case(torch.bfloat16, 4, 2, 16, 48, 12, seed=60, num_pages=3)
    before = kc.clone(), vc.clone()
    for page, offset in ((0, 12), (1, -1), (3, 0), (-1, 5)):  # offsets outside [0, 12), pages outside [0, 3)
        qkv_rope.qkv_rope_write(
            x,
            w,
            b,
            norm=(nw, 1e-6),
            cos=cos,
            sin=sin,
            k_cache=kc,
            v_cache=vc,
            pages=torch.tensor([[page]], device=DEVICE),
            offsets=torch.tensor([[offset]], device=DEVICE),
            num_heads=4,
        )
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    one = torch.tensor([[1]], device=DEVICE)
    kw = dict(cos=cos, sin=sin, k_cache=kc, v_cache=vc, pages=one, offsets=torch.tensor([[3]], device=DEVICE))
    with pytest.raises(ValueError, match="want one"):
        qkv_rope.qkv_rope_write(x, w, b, num_heads=4, **{**kw, "pages": one.expand(1, 2)})
    with pytest.raises(ValueError, match="one token"):
        qkv_rope.qkv_rope_write(x.expand(1, 2, 48), w, b, num_heads=4, **kw)
    with pytest.raises(ValueError, match="Hq"):
        qkv_rope.qkv_rope_write(x, w, b, num_heads=5, **kw)
    with pytest.raises(ValueError, match="int8 weights need"):
        qkv_rope.qkv_rope_write(x, gemv.quantize_int8(w)[0], b, num_heads=4, **kw)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter child run")
def test_interpreter_suite():
    """Run this file's kernel cases on the CPU through Triton's interpreter, in a child pytest."""
    run_in_triton_interpreter(__file__)
