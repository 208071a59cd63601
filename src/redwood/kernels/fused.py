"""Fused Triton kernels for a decoder layer's small ops: one launch where PyTorch eager needs several.

    rms_norm(x, w, eps)                  RMSNorm (≈6 kernels in eager)
    add_rms_norm(x, residual, w, eps)    x + residual, then RMSNorm of the sum (≈7 kernels)
    silu_mul(gate_up, F)                 silu(gate) * up over a fused [.., 2F] projection (2 kernels)
    rope_and_write(q, k, v, cos, sin, k_cache, v_cache, pages, offsets)
                                         rotate-half RoPE of q and k, k and v written into the (paged)
                                         cache (≈10 + 2 index_put kernels); one program per token

Each reproduces the rounding of the PyTorch code it replaces (redwood.models.transformer.RMSNorm,
`F.silu(g) * u`, redwood.models.rope.apply_rotary, KVCache.write): math in float32 with a rounding to
the model dtype wherever eager PyTorch stores a bf16/fp16 intermediate, and no fused multiply-adds
(the kernels are compiled with enable_fp_fusion=False). The elementwise kernels (rope, silu_mul, the
residual add) are therefore bit-identical to eager on CUDA; RMSNorm's mean of squares is a float32
sum in another order than torch's reduction, so its scale factor can differ in the last float32 bit,
which now and then moves a bf16/fp16 output by one ulp (float32 outputs by a few float32 ulps).

All calls are CUDA-graph capturable: no host syncs, outputs allocated from shapes only.

triton is imported guarded (`redwood.kernels.triton_import`): without it this module still imports and
`available` says False.
Under TRITON_INTERPRET=1 (read when this module is imported) the kernels run on CPU tensors in
Triton's interpreter (for tests). There, float32 → bf16 casts truncate, so bf16 rounding is done with
integer arithmetic instead, and exp/division/rsqrt use numpy's instead of CUDA's libdevice, matching
CPU PyTorch's (sum / n rather than CUDA's sum * (1/n) for the mean, too).
"""

from __future__ import annotations

import functools

import torch

from redwood.kernels.triton_import import INTERPRET as _INTERPRET
from redwood.kernels.triton_import import jit as _jit
from redwood.kernels.triton_import import libdevice, tl, triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How a float32 result is rounded to the storage dtype (a constexpr of every kernel).
_KEEP, _TO_BF16, _TO_FP16 = 0, 1, 2
_LAUNCH = dict(enable_fp_fusion=False)  # a*b + c must round twice, as eager PyTorch does


def available(device: torch.device | str, force_interpreter: bool = False) -> bool:
    """Whether the fused kernels run on `device`: CUDA with an importable triton.

    Under TRITON_INTERPRET=1 this says False (the interpreter is far too slow for a model), unless
    `force_interpreter` is set: then it says True for CPU devices (tests).
    """
    device = torch.device(device)
    if triton is None:
        return False
    if _INTERPRET:
        return force_interpreter and device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available()


def _rounding(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise TypeError(f"fused kernels support {_DTYPES}, not {dtype}")
    return {torch.bfloat16: _TO_BF16, torch.float16: _TO_FP16, torch.float32: _KEEP}[dtype]


# ----------------------------------------------------------------------------------------------------
# Kernels


@_jit
def _round(x, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """float32 x → float32 holding x rounded (to nearest even) to bf16 / fp16, or x itself."""
    if ROUND == 1:
        if INTERP:  # the interpreter's float32 → bf16 cast truncates: round with integers
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            y = u.to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@_jit
def _rms_scale(ss, n, inv_n, eps, INTERP: tl.constexpr):
    """RMSNorm's factor 1 / sqrt(mean + eps) from the float32 sum of squares ss of n elements, as torch
    computes it: on CUDA the mean is ss · float32(1/n) (inv_n) and rsqrt is rsqrtf; on the CPU (the
    interpreter) the mean is ss / n and rsqrt is 1 / sqrt. Works elementwise on a tensor of sums."""
    if INTERP:
        return 1.0 / tl.sqrt_rn(tl.math.div_rn(ss, n.to(tl.float32)) + eps)
    return libdevice.rsqrt(ss * inv_n + eps)


@_jit
def _silu_mul(g, u, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """`F.silu(g) * u` on float32 values already rounded to the dtype: silu = g / (1 + exp(-g)) rounded,
    then the product rounded."""
    if INTERP:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)  # expf, as torch's CUDA silu (tl.exp would be ex2.approx)
    s = _round(tl.math.div_rn(g, 1.0 + e), ROUND, INTERP)
    return _round(s * u, ROUND, INTERP)


@_jit
def _rms_norm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, H, inv_h, eps,
                     HAS_RES: tl.constexpr, ROUND_X: tl.constexpr, ROUND_O: tl.constexpr,
                     INTERP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: [h = x + r (rounded to x's dtype), stored]; out = w * rms_norm(h)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    h = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        h = _round(h + r, ROUND_X, INTERP)
        tl.store(RES_OUT + row * stride_ro + offs, h.to(RES_OUT.dtype.element_ty), mask=ok)
    ss = tl.sum(h * h, 0)  # xf.pow(2) is x * x; masked lanes are 0
    scale = _rms_scale(ss, H, inv_h, eps, INTERP)
    n = _round(h * scale, ROUND_X, INTERP)  # xf.to(x.dtype)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    out = _round(w * n, ROUND_O, INTERP)  # weight * normed, in the promoted dtype
    tl.store(OUT + row * stride_o + offs, out.to(OUT.dtype.element_ty), mask=ok)


@_jit
def _silu_mul_kernel(GU, OUT, F, stride_gu, stride_o,
                     ROUND: tl.constexpr, INTERP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(F, BLOCK)): out = round(round(g / (1 + exp(-g))) * u)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < F
    g = tl.load(GU + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + offs, mask=ok, other=0.0).to(tl.float32)
    out = _silu_mul(g, u, ROUND, INTERP)
    tl.store(OUT + row * stride_o + offs, out.to(OUT.dtype.element_ty), mask=ok)


@_jit
def _rotate(X, c1, c2, s1, s2, ok, HALF: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """Rotate-half RoPE of the heads at X ([H, HALF] offsets): x * cos + rotate_half(x) * sin, every
    product and the sum rounded to the dtype as eager PyTorch rounds them."""
    x1 = tl.load(X, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = _round(_round(x1 * c1, ROUND, INTERP) + _round(-x2 * s1, ROUND, INTERP), ROUND, INTERP)
    o2 = _round(_round(x2 * c2, ROUND, INTERP) + _round(x1 * s2, ROUND, INTERP), ROUND, INTERP)
    return o1, o2


@_jit
def _rope_write_kernel(Q, K, V, COS, SIN, KC, VC, PAGES, OFFSETS, QO,
                       sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                       sc_b, sc_t, ss_b, ss_t, skc_p, skc_h, skc_s, svc_p, svc_h, svc_s,
                       spg_b, spg_t, sof_b, sof_t, so_b, so_t, so_h, T, num_pages, page_size,
                       HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                       INTERP: tl.constexpr):
    """One program per token (b * T + t): rotates its Hq query heads into QO, rotates its Hkv key
    heads and writes them and the value heads into the caches at page pages[b, t], offset
    offsets[b, t] (nowhere if either is outside the cache)."""
    bt = tl.program_id(0)
    b = (bt // T).to(tl.int64)
    t = bt % T
    d = tl.arange(0, BLOCK)
    d_ok = d < HALF
    c = COS + b * sc_b + t * sc_t + d
    s = SIN + b * ss_b + t * ss_t + d
    c1 = tl.load(c, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, HQ_PAD)
    q_ok = (hq < HQ)[:, None] & d_ok[None, :]
    o1, o2 = _rotate(Q + b * sq_b + t * sq_t + hq[:, None] * sq_h + d[None, :], c1, c2, s1, s2, q_ok,
                     HALF, ROUND, INTERP)
    dst = QO + b * so_b + t * so_t + hq[:, None] * so_h + d[None, :]
    tl.store(dst, o1.to(QO.dtype.element_ty), mask=q_ok)
    tl.store(dst + HALF, o2.to(QO.dtype.element_ty), mask=q_ok)

    hk = tl.arange(0, HKV_PAD)
    page = tl.load(PAGES + b * spg_b + t * spg_t).to(tl.int64) + tl.zeros([HKV_PAD], dtype=tl.int64)
    off = tl.load(OFFSETS + b * sof_b + t * sof_t).to(tl.int64) + tl.zeros([HKV_PAD], dtype=tl.int64)
    k_ok = (hk < HKV)[:, None] & d_ok[None, :]
    in_cache = (page >= 0) & (page < num_pages) & (off >= 0) & (off < page_size)
    w_ok = k_ok & in_cache[:, None]  # never write outside the cache
    o1, o2 = _rotate(K + b * sk_b + t * sk_t + hk[:, None] * sk_h + d[None, :], c1, c2, s1, s2, k_ok,
                     HALF, ROUND, INTERP)
    dst = KC + page[:, None] * skc_p + hk[:, None] * skc_h + off[:, None] * skc_s + d[None, :]
    tl.store(dst, o1.to(KC.dtype.element_ty), mask=w_ok)
    tl.store(dst + HALF, o2.to(KC.dtype.element_ty), mask=w_ok)
    src = V + b * sv_b + t * sv_t + hk[:, None] * sv_h + d[None, :]
    v1 = tl.load(src, mask=k_ok, other=0.0)
    v2 = tl.load(src + HALF, mask=k_ok, other=0.0)
    dst = VC + page[:, None] * svc_p + hk[:, None] * svc_h + off[:, None] * svc_s + d[None, :]
    tl.store(dst, v1.to(VC.dtype.element_ty), mask=w_ok)
    tl.store(dst + HALF, v2.to(VC.dtype.element_ty), mask=w_ok)


# ----------------------------------------------------------------------------------------------------
# Host side


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] → a [N, H] view with unit last stride (a copy only if no such view exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.contiguous().view(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """redwood's RMSNorm: weight * (xf * rsqrt(mean(xf²) + eps)).to(x.dtype), xf = x.float().

    x: [..., H]; weight: [H]. Returns a new contiguous tensor of x's shape in the dtype of
    `weight * x` (x's dtype when weight has it).
    """
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel.

    x, residual: [..., H] of one dtype; the sum is rounded to it as `x + residual` is. Returns
    (normed, new_residual), both new contiguous tensors of x's shape.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    return _norm(x, residual, weight, eps)


def _norm(x, residual, weight, eps):
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {H}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    round_x, round_o = _rounding(x.dtype), _rounding(out_dtype)
    x2 = _rows(x)
    N = x2.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    o2 = out.view(N, H)
    weight = weight.contiguous()
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        ro2 = res_out.view(N, H)
        r_args = (r2, ro2, r2.stride(0), ro2.stride(0))
    else:
        res_out = None
        r_args = (x2, o2, 0, 0)  # unused
    if N == 0:
        return out, res_out
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(N,)](
        x2, r_args[0], weight, o2, r_args[1], x2.stride(0), r_args[2], o2.stride(0), r_args[3],
        H, _inv(H), float(eps),
        HAS_RES=residual is not None, ROUND_X=round_x, ROUND_O=round_o, INTERP=_INTERPRET,
        BLOCK=block, num_warps=_norm_warps(block), **_LAUNCH,
    )
    return out, res_out


@functools.lru_cache(maxsize=None)
def _inv(n: int) -> float:
    """float32(1) / float32(n): the factor CUDA's mean multiplies the sum by (as a float32 value)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32))


def silu_mul(gate_up: torch.Tensor, F: int | None = None) -> torch.Tensor:  # noqa: N803
    """silu(gate) * up for gate_up = [..., 2F] (gate first, up second) → new contiguous [..., F].

    Rounds as `F.silu(g) * u` does: silu in float32 (x / (1 + exp(-x))), rounded to the dtype, then
    the product rounded. F defaults to half of gate_up's last dim.
    """
    F2 = gate_up.shape[-1]
    if F is None:
        F = F2 // 2
    if 2 * F != F2:
        raise ValueError(f"gate_up's last dim {F2} is not 2 * F = {2 * F}")
    rnd = _rounding(gate_up.dtype)
    gu = _rows(gate_up)
    N = gu.shape[0]
    out = torch.empty(*gate_up.shape[:-1], F, device=gate_up.device, dtype=gate_up.dtype)
    if N == 0 or F == 0:
        return out
    o2 = out.view(N, F)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(N, triton.cdiv(F, block))](
        gu, o2, F, gu.stride(0), o2.stride(0), ROUND=rnd, INTERP=_INTERPRET, BLOCK=block,
        num_warps=max(1, min(4, block // 256)), **_LAUNCH,
    )
    return out


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """apply_rotary to q and k, KVCache.write of (rotated k, v), in one kernel.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (any strides with a unit last stride, e.g. views of one
    fused QKV projection); cos, sin: [B, T, D] as RotaryEmbedding returns them (q's dtype);
    k_cache, v_cache: one layer of a paged cache [P, Hkv, page_size, D] (P physical pages);
    pages, offsets: [B, T] integers (any strides, e.g. expanded) — token (b, t) goes to
    k_cache[pages[b, t], :, offsets[b, t]] (likewise v): the physical place of its logical slot, as
    KVCache.physical gives it. Pages outside [0, P) or offsets outside [0, page_size) are not written.
    A dense cache [B, Hkv, capacity, D] is the case pages = arange(B)[:, None].expand(B, T),
    offsets = slots. Rounds as apply_rotary does in q's dtype.

    Returns rotated q of shape [B, Hq, T, D]: a transpose(1, 2) view of a new contiguous
    [B, T, Hq, D] tensor (so `.transpose(1, 2).reshape(B, T, Hq * D)` is free).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
                         "[B, T, Hq, D], [B, T, Hkv, D], [B, T, Hkv, D]")
    if cos.shape != (B, T, D) or sin.shape != (B, T, D):
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} != [B, T, D] = {(B, T, D)}")
    if D % 2:
        raise ValueError(f"head dim {D} is odd")
    num_pages, page_size = k_cache.shape[0], k_cache.shape[2]
    if k_cache.shape != (num_pages, Hkv, page_size, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} != [P, Hkv, page_size, D]")
    if pages.shape != (B, T) or offsets.shape != (B, T):
        raise ValueError(f"pages {tuple(pages.shape)} / offsets {tuple(offsets.shape)} != [B, T] = {(B, T)}")
    if not (k.dtype == v.dtype == cos.dtype == sin.dtype == q.dtype):
        raise TypeError(f"q, k, v, cos, sin must share a dtype: {q.dtype}, {k.dtype}, {v.dtype}, "
                        f"{cos.dtype}, {sin.dtype}")
    rnd = _rounding(q.dtype)
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a unit last stride (they are written in place)")
    qo = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    if B * T == 0:
        return qo.transpose(1, 2)
    half = D // 2
    block = triton.next_power_of_2(half)
    hq_pad, hkv_pad = triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv)
    _rope_write_kernel[(B * T,)](
        q, k, v, cos, sin, k_cache, v_cache, pages, offsets, qo,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *pages.stride(), *offsets.stride(), *qo.stride()[:3], T,
        num_pages, page_size,
        HQ=Hq, HKV=Hkv, HQ_PAD=hq_pad, HKV_PAD=hkv_pad, HALF=half, BLOCK=block, ROUND=rnd,
        INTERP=_INTERPRET, num_warps=max(1, min(4, hq_pad * block // 256)), **_LAUNCH,
    )
    return qo.transpose(1, 2)
