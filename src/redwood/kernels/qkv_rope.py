"""One token's fused q/k/v projection with rotate-half RoPE and the K/V cache write folded in: the
first kernel of a skinny decoder layer (see redwood.kernels.gemv, whose row sums it shares).

The same arithmetic as `gemv.linear(x, Wqkv, b, norm=…)` followed by
`redwood.kernels.fused.rope_and_write` with the same tile config (bit-identical in Triton's interpreter;
compiled, the float32 sums may run in another order, so a value may sit one ulp away). Graph-capturable.
"""

from __future__ import annotations

import torch

from redwood.kernels import pdl
from redwood.kernels.fused import _INTERPRET, _inv, _round, _rounding
from redwood.kernels.gemv import _row_sums, check_weights
from redwood.kernels.skinny_configs import Config, config_for
from redwood.kernels.triton_import import jit as _jit
from redwood.kernels.triton_import import tl, triton


@_jit
def _qkv_rope_kernel(X, W, SCALE, BIAS, NW, COS, SIN, PAGES, OFFSETS, QO, KC, VC, K, stride_w, skc_p, skc_h,
                     skc_s, svc_p, svc_h, svc_s, num_pages, page_size, inv_k, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, ROT_PROGRAMS: tl.constexpr,
                     QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr,
                     INTERP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr):
    """The fused q/k/v projection of one token with rotate-half RoPE and the cache write folded in.

    Rows of W: Hq query heads, then Hkv key heads, then Hkv value heads, D = 2·HALF rows each. The first
    cdiv((Hq + Hkv)·HALF, BLOCK_N) programs each take BLOCK_N rotation pairs (rows h·D + j and
    h·D + HALF + j of a query or key head h): both sums, rounded to the dtype as the projection's output
    is, rotated as apply_rotary rounds (x1·c − x2·s, x2·c + x1·s, every product and sum rounded), then
    stored to QO (queries) or the key cache at the token's (page, offset). The remaining programs take
    BLOCK_N value rows each and store them, rounded, into the value cache. A page outside [0, num_pages)
    or an offset outside [0, page_size) is not written."""
    pid = tl.program_id(0)
    D = 2 * HALF
    n_pairs = (HQ + HKV) * HALF
    if pid < ROT_PROGRAMS:  # cdiv((Hq + Hkv)·HALF, BLOCK_N), from the host
        pair = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = pair < n_pairs
        head = pair // HALF
        j = pair % HALF
        r1 = head * D + j
        x1, x2 = _row_sums(X, W, SCALE, BIAS, NW, r1, r1 + HALF, ok, K, stride_w, inv_k, eps,
                           QUANT, HAS_BIAS, NORM, True, INTERP, BLOCK_N, BLOCK_K, STAGES, PDL)
        page, off, dst_ok = _dest(PAGES, OFFSETS, num_pages, page_size, BLOCK_N)
        x1 = _round(x1, ROUND, INTERP)
        x2 = _round(x2, ROUND, INTERP)
        c1 = tl.load(COS + j).to(tl.float32)
        c2 = tl.load(COS + HALF + j).to(tl.float32)
        s1 = tl.load(SIN + j).to(tl.float32)
        s2 = tl.load(SIN + HALF + j).to(tl.float32)
        o1 = _round(_round(x1 * c1, ROUND, INTERP) + _round(-x2 * s1, ROUND, INTERP), ROUND, INTERP)
        o2 = _round(_round(x2 * c2, ROUND, INTERP) + _round(x1 * s2, ROUND, INTERP), ROUND, INTERP)
        is_q = head < HQ
        q_dst = QO + head * D + j
        tl.store(q_dst, o1.to(QO.dtype.element_ty), mask=ok & is_q)
        tl.store(q_dst + HALF, o2.to(QO.dtype.element_ty), mask=ok & is_q)
        k_dst = KC + page * skc_p + (head - HQ).to(tl.int64) * skc_h + off * skc_s + j
        k_ok = ok & (head >= HQ) & dst_ok
        tl.store(k_dst, o1.to(KC.dtype.element_ty), mask=k_ok)
        tl.store(k_dst + HALF, o2.to(KC.dtype.element_ty), mask=k_ok)
    else:
        i = (pid - ROT_PROGRAMS) * BLOCK_N + tl.arange(0, BLOCK_N)  # value row: head i // D, dim i % D
        ok = i < HKV * D
        v, _ = _row_sums(X, W, SCALE, BIAS, NW, (HQ + HKV) * D + i, i, ok, K, stride_w, inv_k, eps,
                         QUANT, HAS_BIAS, NORM, False, INTERP, BLOCK_N, BLOCK_K, STAGES, PDL)
        page, off, dst_ok = _dest(PAGES, OFFSETS, num_pages, page_size, BLOCK_N)
        v = _round(v, ROUND, INTERP)
        v_dst = VC + page * svc_p + (i // D).to(tl.int64) * svc_h + off * svc_s + i % D
        tl.store(v_dst, v.to(VC.dtype.element_ty), mask=ok & dst_ok)


@_jit
def _dest(PAGES, OFFSETS, num_pages, page_size, BLOCK_N: tl.constexpr):
    """The token's physical page and offset as [BLOCK_N] vectors (mask operands) and whether they lie in
    the cache."""
    page = tl.load(PAGES).to(tl.int64) + tl.zeros([BLOCK_N], dtype=tl.int64)
    off = tl.load(OFFSETS).to(tl.int64) + tl.zeros([BLOCK_N], dtype=tl.int64)
    return page, off, (page >= 0) & (page < num_pages) & (off >= 0) & (off < page_size)


def qkv_rope_write(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                   offsets: torch.Tensor, num_heads: int, scale: torch.Tensor | None = None,
                   norm: tuple[torch.Tensor, float] | None = None,
                   config: Config | None = None) -> torch.Tensor:
    """`linear(x, weight, bias, norm=…)` for the fused q/k/v weight of one token, then what
    `redwood.kernels.fused.rope_and_write` does with it — in one kernel.

    x: [1, 1, H] (one row, one token); weight: [(Hq + 2·Hkv)·D, H] (or int8 with `scale`); cos, sin:
    [1, 1, D] in x's dtype; k_cache, v_cache: one layer of a paged cache [P, Hkv, page_size, D] (any P:
    the pages of every row); pages, offsets: [1, 1] integers — the token goes to
    k_cache[pages, :, offsets] (as rope_and_write; a page outside [0, P) or an offset outside
    [0, page_size) is not written; a dense one-row cache is pages = 0, offsets = slot).
    Returns the rotated queries [1, Hq, 1, D] (a transpose view of [1, 1, Hq, D], as rope_and_write)."""
    B, T, H = x.shape
    if B * T != 1:
        raise ValueError(f"qkv_rope_write takes one token, got x of shape {tuple(x.shape)}")
    num_pages, Hkv, page_size, D = k_cache.shape
    if v_cache.shape != k_cache.shape or D % 2:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}: want [P, Hkv, page_size, even D]")
    if weight.shape != ((num_heads + 2 * Hkv) * D, H):
        raise ValueError(f"weight {tuple(weight.shape)} != [(Hq + 2·Hkv)·D, H] = {((num_heads + 2 * Hkv) * D, H)}")
    if cos.shape[-1] != D or sin.shape[-1] != D or cos.numel() != D or sin.numel() != D:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: want one row of D = {D}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype or k_cache.dtype != x.dtype or v_cache.dtype != x.dtype:
        raise TypeError("x, cos, sin and the caches must share a dtype")
    if pages.numel() != 1 or offsets.numel() != 1:
        raise ValueError(f"pages {tuple(pages.shape)} / offsets {tuple(offsets.shape)}: want one [1, 1] each")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches need a unit last stride (they are written in place)")
    int8 = check_weights(x, weight, bias, scale)
    x2 = x.reshape(1, H).contiguous()
    cos, sin = cos.reshape(D).contiguous(), sin.reshape(D).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    qo = torch.empty(1, 1, num_heads, D, device=x.device, dtype=x.dtype)
    half = D // 2
    block_n, block_k, warps, stages = config or config_for(weight.shape[0] // 2, H, True, x.device, int8)
    rot_programs = triton.cdiv((num_heads + Hkv) * half, block_n)
    n_programs = rot_programs + triton.cdiv(Hkv * D, block_n)
    nw, eps = (norm[0].contiguous(), float(norm[1])) if norm is not None else (weight, 0.0)
    use_pdl = pdl.enabled(x.device)
    _qkv_rope_kernel[(n_programs,)](
        x2, weight, scale if int8 else weight, bias if bias is not None else weight, nw, cos, sin, pages, offsets,
        qo, k_cache, v_cache, H, weight.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], num_pages,
        page_size, _inv(H), eps, HQ=num_heads, HKV=Hkv, HALF=half, ROT_PROGRAMS=rot_programs,
        QUANT=int8,
        HAS_BIAS=bias is not None, NORM=norm is not None, ROUND=_rounding(x.dtype), INTERP=_INTERPRET,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=use_pdl, num_warps=warps,
        **pdl.launch_options(use_pdl),
    )
    return qo.transpose(1, 2)
