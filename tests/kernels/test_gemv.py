"""The skinny-matmul kernel (redwood.kernels.gemv) against float64 matmuls and the model's eager ops.

Exactness: the product is a float32 sum in another order than any reference, so a bf16/fp16 output may
sit one ulp away from the float64 product rounded to the dtype (rare: where the float32 sum lands near
a rounding boundary); fp32 outputs are within float32 accumulation error. The fused ops on top round as
eager PyTorch does, so the same bound holds after them (residual add, SiLU·up), plus the norm's last-bit
scale difference (see test_fused).

Where they run: on CUDA in this process when a GPU is there; on the CPU through Triton's interpreter in
a child pytest of this file (`test_interpreter_suite`), as test_fused does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from redwood.config import ExecutionConfig  # noqa: E402
from redwood.kernels import gemv  # noqa: E402
from redwood.models.transformer import RMSNorm  # noqa: E402
from tests.conftest import capture_cuda_graph, interpreter_broken, run_in_triton_interpreter  # noqa: E402
from tests.kernels.test_fused import DEVICE, DTYPES, INTERPRET, gen, needs_kernel, randn  # noqa: E402

if INTERPRET and (why := interpreter_broken()):  # the K loop's bound is a kernel argument
    pytest.skip(why, allow_module_level=True)
# (N, K): odd sizes exercise the masks; on the GPU the real 1.5B / 0.5B projection shapes
SHAPES = (
    [(24, 80), (40, 96), (9, 200), (1, 3)]
    if INTERPRET
    else [(2048, 1536), (1536, 8960), (1152, 896), (896, 4864), (17920, 1536), (151936, 896), (100, 70)]
)


def reference_linear(x, w, b=None):
    """x @ wᵀ + b in float64, rounded once to x's dtype."""
    out = F.linear(x.double(), w.double(), None if b is None else b.double())
    return out.to(x.dtype)


ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}  # relative, at most


def check(out, ref, ulps: int = 1):
    """out within `ulps` units in the last place of ref (relative), or within float32 accumulation error
    of the output's scale where ref nearly cancels to zero. NaN never passes."""
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * ULP[out.dtype], atol=2e-5 * scale)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 3, 8, 33])
def test_linear(dtype, N, K, bias, M):
    """One row through the GEMV kernel, 2-64 rows through the tensor-core tile kernel (33: 64-row tiles,
    rows past M masked)."""
    g = gen(7 + N + M)
    x = randn(g, M, K, dtype=dtype)
    w = randn(g, N, K, dtype=dtype, scale=K**-0.5)
    b = randn(g, N, dtype=dtype) if bias else None
    out = gemv.linear(x, w, b)
    assert out.shape == (M, N) and out.dtype == dtype
    check(out, reference_linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_strided_rows(dtype):
    g = gen(3)
    x = randn(g, 1, 1, 2 * 96, dtype=dtype)[..., ::2]  # [1, 1, 96] with a stride-2 last dim
    w = randn(g, 50, 96, dtype=dtype, scale=0.1)
    out = gemv.linear(x, w)
    assert out.shape == (1, 1, 50)
    check(out, reference_linear(x, w))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES[:3])
@pytest.mark.parametrize("M", [1, 4, 64])
def test_norm_folded_in(dtype, N, K, M):
    """linear(x, W, norm=(g, eps)) == RMSNorm(x) @ Wᵀ with the norm in float64 (not rounded between;
    2-8 rows feed x_k · g_k to the 16-bit dot as hi + lo parts, ~16 bits: within the same bound)."""
    g = gen(11)
    x = randn(g, M, K, dtype=dtype, scale=4.0)
    w = randn(g, N, K, dtype=dtype, scale=K**-0.5)
    norm = RMSNorm(K, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(K, generator=g) * 1.5 + 0.5)
    out = gemv.linear(x, w, norm=(norm.weight, norm.eps))
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    check(out, F.linear(normed, w.double()).to(dtype), ulps=1 if M == 1 else 2)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES[:3])
@pytest.mark.parametrize("M", [1, 5, 20])
def test_residual_epilogue_updates_in_place(dtype, N, K, M):
    g = gen(12)
    x = randn(g, M, K, dtype=dtype)
    w = randn(g, N, K, dtype=dtype, scale=K**-0.5)
    r = randn(g, M, N, dtype=dtype, scale=8.0)
    before = r.clone()
    out = gemv.linear(x, w, residual=r)
    assert out is r
    y = reference_linear(x, w)
    # r + y rounds as eager does, on a y that may be one ulp off: where r + y cancels, that ulp of |y| is
    # all the difference (larger than an ulp of the small sum)
    torch.testing.assert_close(
        r.float(), (before + y).float(), rtol=ULP[dtype], atol=ULP[dtype] * y.abs().max().item() + 2e-5
    )


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F_,K", [(40, 96), (72, 64)] if INTERPRET else [(8960, 1536), (4864, 896)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 2, 64])
def test_silu_mul_epilogue(dtype, F_, K, bias, M):
    g = gen(13)
    x = randn(g, M, K, dtype=dtype)
    w = randn(g, 2 * F_, K, dtype=dtype, scale=2 * K**-0.5)
    b = randn(g, 2 * F_, dtype=dtype) if bias else None
    out = gemv.linear(x, w, b, silu_mul=True)
    assert out.shape == (M, F_)
    gu = reference_linear(x, w, b)
    check_silu_mul(out, gu[:, :F_], gu[:, F_:])


def _neighbours(t: torch.Tensor) -> list[torch.Tensor]:
    """t and the adjacent representable values of its dtype on either side (±1 in the bit pattern)."""
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    bits = t.view(ints)
    return [t, (bits + 1).view(t.dtype), (bits - 1).view(t.dtype)]


def check_silu_mul(out, g, u):
    """The kernel rounds its float32 projections g, u to the dtype and then computes F.silu(g) * u as eager
    PyTorch does; the float64 reference's g, u are the same to within one unit in the last place (the
    float32 accumulation can put a value just across a rounding boundary), and silu amplifies a relative
    change of g by up to |g·silu'(g) / silu(g)| (≈ 1 + |g| for negative g). So `out` must lie within an ulp
    of silu(g') * u' for some neighbours g', u' of the reference's g, u (or within the float32 accumulation
    error of the output's scale where the product nearly cancels)."""
    refs = torch.stack([(F.silu(gg) * uu).float() for gg in _neighbours(g) for uu in _neighbours(u)])
    lo, hi = refs.min(0).values, refs.max(0).values
    o = out.float()
    tol = ULP[out.dtype] * torch.maximum(lo.abs(), hi.abs()) + 2e-5 * max(1.0, hi.abs().max().item())
    bad = (o < lo - tol) | (o > hi + tol) | o.isnan()
    assert not bad.any(), (
        f"{int(bad.sum())} of {o.numel()} outside [lo, hi] ± tol, e.g. at "
        f"{bad.nonzero()[0].tolist()}: {o[bad][0].item()} vs [{lo[bad][0].item()}, {hi[bad][0].item()}]"
    )


# 2-8 rows: the CUDA-core rows kernel (configs with BLOCK_N < 16) and the tensor-core tile kernel (≥ 16)
ROWS_GEMV = (4, 32 if INTERPRET else 512, 4, 1)
ROWS_TILE = (16, 32 if INTERPRET else 128, 4, 1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [2, 5, 8])
def test_rows_kernel_rows_are_the_one_row_kernels(dtype, M):
    """Each row through the CUDA-core rows kernel is that row through the one-row kernel with the same
    config: the same tile sums in the same order (bit for bit in the interpreter; compiled, within an
    ulp), with bias, SiLU·up and int8 weights."""
    N, K = (40, 96) if INTERPRET else (1536, 1536)
    g = gen(70 + M)
    x = randn(g, M, K, dtype=dtype)
    w = randn(g, 2 * N, K, dtype=dtype, scale=K**-0.5)
    b = randn(g, 2 * N, dtype=dtype)
    cases = [dict(weight=w, bias=b), dict(weight=w, bias=b, silu_mul=True)]
    if dtype != torch.float32:
        q, sc = gemv.quantize_int8(w)
        cases.append(dict(weight=q, bias=b, scale=sc))
    for kw in cases:
        rows = gemv.linear(x, config=ROWS_GEMV, **kw)
        one = torch.cat([gemv.linear(x[i : i + 1], config=ROWS_GEMV, **kw) for i in range(M)])
        if INTERPRET:
            assert torch.equal(rows, one)
        else:  # an ulp in gate and up moves SiLU·up by up to ~3
            check(rows, one, ulps=3 if kw.get("silu_mul") else 1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config,M",
    [(ROWS_GEMV, 3), (ROWS_GEMV, 8), (ROWS_TILE, 3), (ROWS_TILE, 8), (ROWS_TILE, 17), (ROWS_TILE, 64)],
    ids=["rows-gemv-3", "rows-gemv-8", "tile-3", "tile-8", "tile-17", "tile-64"],
)
def test_both_rows_kernels_with_every_fused_op(dtype, config, M):
    """norm + bias + SiLU·up, and the residual epilogue, through either 2-8-row kernel and the tile
    kernel's 32- and 64-row tiles (float64 refs)."""
    N, K = (24, 80) if INTERPRET else (2048, 1536)
    g = gen(80 + M)
    x = randn(g, M, K, dtype=dtype, scale=3.0)
    w = randn(g, 2 * N, K, dtype=dtype, scale=K**-0.5)
    b = randn(g, 2 * N, dtype=dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype).to(DEVICE)
    out = gemv.linear(x, w, b, norm=(nw, 1e-6), silu_mul=True, config=config)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    gu = F.linear(normed, w.double(), b.double()).to(dtype)
    check(out, F.silu(gu[:, :N]) * gu[:, N:], ulps=4)
    r = randn(g, M, 2 * N, dtype=dtype, scale=4.0)
    before = r.clone()
    assert gemv.linear(x, w, residual=r, config=config) is r
    y = reference_linear(x, w)
    torch.testing.assert_close(
        r.float(), (before + y).float(), rtol=ULP[dtype], atol=ULP[dtype] * y.abs().max().item() + 2e-5
    )


def test_quantize_int8_rows():
    """Per-row symmetric int8: every weight within half a step of its row's scale; zero rows stay zero."""
    w = torch.randn(6, 50, generator=gen(40)) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0, 3.0])[:, None]
    w[5, 7] = -300.0  # one outlier sets its row's scale
    q, scale = gemv.quantize_int8(w.to(torch.bfloat16))
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    assert q.abs().max() <= 127 and (q[4] == 0).all() and scale[4] == 1.0
    deq = q.float() * scale[:, None]
    assert ((deq - w.to(torch.bfloat16).float()).abs() <= scale[:, None] / 2 + 1e-6).all()


def dequantized(q, scale):
    return q.double() * scale.double()[:, None]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("op", ["plain", "norm", "residual", "silu"])
@pytest.mark.parametrize("M", [1, 3])
def test_int8_weights(dtype, op, M):
    """int8 weights with per-row scales == the same product with the dequantized weights (float64)."""
    N, K = (40, 96) if INTERPRET else (2048, 1536)
    g = gen(41)
    rows = 2 * N if op == "silu" else N
    x = randn(g, M, K, dtype=dtype, scale=2.0)
    q, scale = gemv.quantize_int8(randn(g, rows, K, dtype=dtype, scale=K**-0.5))
    b = randn(g, rows, dtype=dtype)
    w = dequantized(q, scale)
    xd = x.double()
    if op == "norm":
        nw = randn(g, K, dtype=dtype)
        out = gemv.linear(x, q, b, scale=scale, norm=(nw, 1e-6))
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
        check(out, F.linear(xd, w, b.double()).to(dtype), ulps=1 if M == 1 else 2)
    elif op == "residual":
        r = randn(g, M, N, dtype=dtype)
        expect = r + F.linear(xd, w, b.double()).to(dtype)
        check(gemv.linear(x, q, b, scale=scale, residual=r), expect)
    elif op == "silu":
        gu = F.linear(xd, w, b.double()).to(dtype)
        check(gemv.linear(x, q, b, scale=scale, silu_mul=True), F.silu(gu[:, :N]) * gu[:, N:], ulps=3)
    else:
        check(gemv.linear(x, q, b, scale=scale), F.linear(xd, w, b.double()).to(dtype))


@needs_kernel
def test_bad_input():
    x = torch.zeros(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        gemv.linear(x, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(TypeError, match="share a dtype"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="at most"):
        gemv.linear(torch.zeros(gemv.MAX_ROWS + 1, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="tile kernel"):  # > 8 rows: no CUDA-core rows configs
        gemv.linear(torch.zeros(9, 16, device=DEVICE), torch.zeros(4, 16, device=DEVICE), config=ROWS_GEMV)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE), residual=torch.zeros(1, 8, device=DEVICE)[:, ::2])
    with pytest.raises(ValueError, match="even row count"):
        gemv.linear(x, torch.zeros(5, 16, device=DEVICE), silu_mul=True)
    with pytest.raises(ValueError, match="residual"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE), residual=torch.zeros(1, 5, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE), torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="norm weight"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE), norm=(torch.ones(8, device=DEVICE), 1e-6))
    q8 = torch.zeros(4, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="float32 scale per row"):
        gemv.linear(x, q8)
    with pytest.raises(ValueError, match="float32 scale per row"):
        gemv.linear(x, q8, scale=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="int8 weights only"):
        gemv.linear(x, torch.zeros(4, 16, device=DEVICE), scale=torch.ones(4, device=DEVICE))


# ----------------------------------------------------------------------------------------------------
# The model's skinny path


@needs_kernel
def test_model_skinny_path_matches_the_eager_model(tiny_model_dir):
    """A float32 model's forwards of 1-4 tokens (after a 5-token prefill, which takes the other path)
    through the skinny kernels give the logits and cache of the model without them (plain layers on the
    CPU; cuBLAS matmuls + the fused small-op kernels on CUDA)."""
    from redwood.loading import load_model

    eager = load_model(tiny_model_dir, dtype="float32", device=DEVICE, execution=ExecutionConfig(skinny=False)).model
    skinny = copy.deepcopy(eager)
    # (kernels="on": on the CPU the kernels run only in the interpreter); 2-4-token forwards through the tile
    # kernel too
    skinny.set_execution(ExecutionConfig(kernels="on", skinny_rows=4))
    gen_ = torch.Generator().manual_seed(0)
    V = eager.config.vocab_size
    caches = [m.new_cache(1, 16) for m in (eager, skinny)]
    for T in (5, 1, 3, 1, 4):
        ids = torch.randint(0, V, (1, T), generator=gen_).to(DEVICE)
        pos = caches[0].lengths[:, None] + torch.arange(T, device=DEVICE)[None]
        with torch.inference_mode():
            ref = eager(ids, pos, caches[0])
            out = skinny(ids, pos, caches[1])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for c in caches:
            c.commit(torch.full((1,), T, device=DEVICE))
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_model_batched_forwards_through_the_tile_kernel(tiny_model_dir):
    """skinny_tile_rows: batched forwards of batch × tokens within the range (here 24, 12 and 18 rows) take
    the skinny path's tile kernel and give the logits and cache of the model without it; 6 rows (below
    the range, above skinny_rows) take the other path."""
    from redwood.loading import load_model

    eager = load_model(tiny_model_dir, dtype="float32", device=DEVICE, execution=ExecutionConfig(skinny=False)).model
    tiled = copy.deepcopy(eager)
    tiled.set_execution(ExecutionConfig(kernels="on", skinny_rows=1, skinny_tile_rows=(9, 64)))
    assert [tiled.backend.takes_skinny(n) for n in (1, 2, 8, 9, 64, 65)] == [True, False, False, True, True, False]
    gen_ = torch.Generator().manual_seed(1)
    B, V = 6, eager.config.vocab_size
    caches = [m.new_cache(B, 16) for m in (eager, tiled)]
    for T in (4, 2, 1, 3):
        ids = torch.randint(0, V, (B, T), generator=gen_).to(DEVICE)
        pos = caches[0].lengths[:, None] + torch.arange(T, device=DEVICE)[None]
        with torch.inference_mode():
            ref = eager(ids, pos, caches[0])
            out = tiled(ids, pos, caches[1])
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for c in caches:
            c.commit(torch.full((B,), T, device=DEVICE))
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_model_int8_skinny_path_matches_dequantized_weights(tiny_model_dir):
    """quantize_skinny: one-token forwards read int8 copies; they equal a model whose projection and LM
    head weights are the dequantized int8 values; forwards of more tokens keep the original weights."""
    from redwood.loading import load_model

    model = load_model(tiny_model_dir, dtype="float32", device=DEVICE, execution=ExecutionConfig(kernels="on")).model
    reference = copy.deepcopy(model)
    reference.set_execution(ExecutionConfig(kernels="on", skinny=False))
    model.quantize_skinny("int8")
    q8 = model.skinny_int8
    with torch.no_grad():
        for layer, w in zip(reference.layers, q8["layers"]):
            layer.self_attn.qkv[0].copy_(dequantized(*w["qkv"]))
            layer.self_attn.o_proj.weight.copy_(dequantized(*w["o"]))
            layer.mlp.gate_up[0].copy_(dequantized(*w["gate_up"]))
            layer.mlp.down_proj.weight.copy_(dequantized(*w["down"]))
        reference.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        reference.lm_head.weight.copy_(dequantized(*q8["lm_head"]))
        reference.lm_head.to(DEVICE)
    ids = torch.tensor([[5, 6, 7, 8, 9]], device=DEVICE)
    caches = [model.new_cache(1, 16) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:  # a 5-token prefill: the original weights (only one-token forwards read int8)
            model(ids, torch.arange(5, device=DEVICE)[None], c)
            c.commit(5)
        out = model(ids[:, :1], torch.tensor([[5]], device=DEVICE), caches[0])
        ref = reference(ids[:, :1], torch.tensor([[5]], device=DEVICE), caches[1])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0].k, caches[1].k, rtol=1e-4, atol=1e-5)


def test_quantize_skinny_needs_the_kernels(tiny_model_dir):
    from redwood.errors import ConfigError
    from redwood.loading import load_model

    model = load_model(tiny_model_dir, dtype="float32", device="cpu").model
    with pytest.raises(ConfigError, match="matrix-vector kernels"):
        model.quantize_skinny("int8")
    with pytest.raises(ConfigError, match="only 'int8'"):
        model.quantize_skinny("int4")


# ----------------------------------------------------------------------------------------------------
# CUDA graphs, availability, the interpreter run


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_cuda_graph_capture():
    dtype = torch.bfloat16
    g = gen(20)
    x, r = randn(g, 1, 1536, dtype=dtype), randn(g, 1, 1536, dtype=dtype)
    w, wgu = randn(g, 1536, 1536, dtype=dtype, scale=0.03), randn(g, 2 * 8960, 1536, dtype=dtype, scale=0.03)
    nw = randn(g, 1536, dtype=dtype)

    def step():
        return gemv.linear(x, wgu, norm=(nw, 1e-6), silu_mul=True), gemv.linear(x, w, residual=r)

    graph, (act, _) = capture_cuda_graph(step)
    x.copy_(randn(g, 1, 1536, dtype=dtype))
    r.copy_(randn(g, 1, 1536, dtype=dtype))
    r0 = r.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(act, gemv.linear(x, wgu, norm=(nw, 1e-6), silu_mul=True))
    assert torch.equal(r, gemv.linear(x, w, residual=r0.clone()))


def test_available():
    assert not gemv.available("cpu")
    if INTERPRET:
        assert gemv.available("cpu", force_interpreter=True)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter child run")
def test_interpreter_suite():
    """Run this file's kernel cases on the CPU through Triton's interpreter, in a child pytest."""
    run_in_triton_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (tl.range pipelining)")
@pytest.mark.parametrize("silu", [False, True])
def test_software_pipelined_configs(silu):
    """Configs with num_stages > 1 (the tl.range loop) give what the plain loop gives, bit for bit."""
    g = gen(30)
    x, w = randn(g, 1, 1536, dtype=torch.bfloat16), randn(g, 2 * 1000, 1536, dtype=torch.bfloat16, scale=0.03)
    plain = gemv.linear(x, w, silu_mul=silu, config=(4, 512, 4, 1))
    assert torch.equal(gemv.linear(x, w, silu_mul=silu, config=(4, 512, 4, 2)), plain)
