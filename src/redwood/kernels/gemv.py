"""Skinny matmuls — one to eight rows of activations: batch-1 decoding, chain drafting, short verifies —
with the layer's small ops fused into their prologue or epilogue.

At batch 1 a decoder layer is a chain of matrix-vector products whose cost is reading the weights, and
every norm, residual add and activation between them is one more launch of a few microseconds inside a
CUDA graph. `linear` reads each weight row once and folds the neighbours in:

    linear(x, W, b)                              x @ Wᵀ + b
    linear(x, W, b, norm=(g, eps))               rms_norm(x; g) @ Wᵀ + b        (norm folded in)
    linear(x, W, b, residual=r)                  r += x @ Wᵀ + b, in place       (residual epilogue)
    linear(x, W, b, silu_mul=True)               silu(x @ W[:F]ᵀ) * (x @ W[F:]ᵀ) (W = [gate; up])
    linear(x, Q, b, scale=s, …)                  the same with int8 weights Q and per-row scales s
    qkv_rope.qkv_rope_write(x, Wqkv, b, …)       one token's q/k/v projection + RoPE + K/V cache write

so a pre-norm layer for one token is four kernels (q/k/v with the input norm, RoPE and the cache write;
o_proj with the residual; gate/up with the post-attention norm and SiLU; down with the residual) plus
attention, instead of nine launches. One row runs a GEMV kernel (CUDA cores, many programs of a few
weight rows); 2-8 rows the same shape of kernel with every weight tile applied to each row in turn
(configs with BLOCK_N < 16), or a tile kernel (tl.dot over 16 padded activation rows × ≥ 16 weight rows;
configs with BLOCK_N ≥ 16) — the tuned table picks per shape; 9-64 rows (batched decoding and drafting:
MagicDec's batch-64 draft levels) the tile kernel over 16 / 32 / 64 padded rows, which saves the separate
norm, SiLU and residual kernels cuBLAS needs around it.

Rounding: products are accumulated in float32 (in another order than cuBLAS, so a bf16 output can sit
one ulp from F.linear's where the float32 sum lands near a rounding boundary) and rounded to the dtype;
the epilogue ops round as eager PyTorch does (`r + y`, `F.silu(g) * u`, apply_rotary). The folded norm
is s · Σ_k (x_k g_k) W[n, k] with s from the row's mean square: in float32 in the CUDA-core kernels (the
eager RMSNorm rounds its output to the dtype before the matmul — this is closer to the exact value); the
tile kernel feeds x_k g_k to its 16-bit dot as two parts (hi + lo), ~16 bits.

Layout: x [..., K] with unit last stride; W [N, K] row-major (nn.Linear's), so each program reads
BLOCK_N whole weight rows, contiguous along K. Grid: cdiv(N, BLOCK_N) programs, each looping over K.
Tile configs: redwood.kernels.skinny_configs (a per-GPU table measured by benchmarks/gemv_bench.py, else a
heuristic). Graph-capturable (no host syncs; outputs allocated from shapes only); inside a captured step
the kernels may be launched with programmatic dependent launch (redwood.kernels.pdl).
"""

from __future__ import annotations

import torch

from redwood.kernels import pdl
from redwood.kernels.fused import _INTERPRET, _inv, _rms_scale, _round, _rounding, _silu_mul
from redwood.kernels.fused import available as _fused_available
from redwood.kernels.skinny_configs import Config, config_for
from redwood.kernels.triton_import import jit as _jit
from redwood.kernels.triton_import import tl, triton

MAX_ROWS = 64  # activation rows `linear` takes: one through the GEMV kernel, 2-64 through a tensor-core tile
GEMV_ROWS = 8  # ... or 2-8 through the CUDA-core rows kernel (configs with BLOCK_N < 16)


def available(device: torch.device | str, force_interpreter: bool = False) -> bool:
    """Whether `linear` runs on `device` (the same condition as redwood.kernels.fused)."""
    return _fused_available(device, force_interpreter)


@_jit
def _row_sums(X, W, SCALE, BIAS, NW, rows, rows2, ok, K, stride_w, inv_k, eps,
              QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, TWO: tl.constexpr,
              INTERP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
              PDL: tl.constexpr):
    """Σ_k x'[k] · W[r, k] (+ bias[r]) in float32 for the weight rows `rows` [BLOCK_N] (and `rows2`
    when TWO), over W tiles [BLOCK_N, BLOCK_K]; rows where `ok` is False read nothing.

    x' = x, or with NORM its RMSNorm folded in without a second pass over x:
    Σ_k (x_k · s · g_k) · W[r, k] = s · Σ_k (x_k · g_k) · W[r, k], the row's mean square (→ s) summed in
    the same loop (x_k · g_k is exact in float32 for 16-bit inputs). QUANT: W holds int8 with a float32
    scale per row, applied once to each row's sum.
    PDL (redwood.kernels.pdl): the first weight tile is prefetched into L2 before waiting for the
    previous kernel (weights are constant within a forward); everything is read after the wait, by the
    same loop as without PDL (so the sums are the same, bit for bit). Callers read and write nothing
    before calling this."""
    p1 = W + rows.to(tl.int64)[:, None] * stride_w
    p2 = W + rows2.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if PDL:
        _pdl_prologue(p1, p2, ok, K, TWO, BLOCK_K)
    if STAGES > 1:  # software-pipelined loads (tl.range); triton 3.6's interpreter cannot run tl.range
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc, acc2, ss = _tile(X, NW, p1, p2, ok, k0, K, acc, acc2, ss, NORM, TWO, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, acc2, ss = _tile(X, NW, p1, p2, ok, k0, K, acc, acc2, ss, NORM, TWO, BLOCK_K)
    if QUANT:
        acc = acc * tl.load(SCALE + rows, mask=ok, other=0.0)
        if TWO:
            acc2 = acc2 * tl.load(SCALE + rows2, mask=ok, other=0.0)
    if NORM:
        scale = _rms_scale(tl.sum(ss, 0), K, inv_k, eps, INTERP)
        acc = acc * scale
        acc2 = acc2 * scale
    if HAS_BIAS:
        acc += tl.load(BIAS + rows, mask=ok, other=0.0).to(tl.float32)
        if TWO:
            acc2 += tl.load(BIAS + rows2, mask=ok, other=0.0).to(tl.float32)
    return acc, acc2


@_jit
def _pdl_prologue(p1, p2, ok, K, TWO: tl.constexpr, BLOCK_K: tl.constexpr):
    """The start of a PDL kernel that reads weight rows p1 (and p2 when TWO) [BLOCK_N, 1]: let the next
    kernel be scheduled, prefetch this program's first weight tile [BLOCK_N, BLOCK_K] into L2 (one hint
    per 128-byte line; hints load nothing into registers, so the sums after are those of the kernel
    without PDL), then wait until the previous kernel has finished and its writes are visible."""
    tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be scheduled (it waits for us)
    _prefetch_l2(p1, ok, K, BLOCK_K)
    if TWO:
        _prefetch_l2(p2, ok, K, BLOCK_K)
    tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, the norm's input) are visible now


@_jit
def _prefetch_l2(p, ok, K, BLOCK_K: tl.constexpr):
    """L2 prefetch hints for columns [0, BLOCK_K) of the rows p [BLOCK_N, 1] where ok: one per 128-byte
    line (a hint never faults, but addresses past the rows are not hinted)."""
    LINE: tl.constexpr = 1024 // p.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    ks = tl.arange(0, BLOCK_K)
    hint = ok[:, None] & ((ks < K) & (ks % LINE == 0))[None, :]
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [p + ks[None, :], hint.to(tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@_jit
def _weight_tile(p1, p2, ok, k0, K, TWO: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile(s) [BLOCK_N, BLOCK_K] at columns k0… of rows p1 (and p2 when TWO), as float32."""
    ks = k0 + tl.arange(0, BLOCK_K)
    w_ok = ok[:, None] & (ks < K)[None, :]
    w = tl.load(p1 + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
    u = w
    if TWO:
        u = tl.load(p2 + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
    return w, u


@_jit
def _tile(X, NW, p1, p2, ok, k0, K, acc, acc2, ss,
          NORM: tl.constexpr, TWO: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile of _row_sums: the weight tile(s) [BLOCK_N, BLOCK_K] times x[k0 : k0 + BLOCK_K], added
    to acc (acc2)."""
    w, u = _weight_tile(p1, p2, ok, k0, K, TWO, BLOCK_K)
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x = tl.load(X + ks, mask=k_ok, other=0.0).to(tl.float32)
    if NORM:
        ss += x * x
        x = x * tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
    acc += tl.sum(w * x[None, :], 1)
    if TWO:
        acc2 += tl.sum(u * x[None, :], 1)
    return acc, acc2, ss


@_jit
def _gemv_kernel(X, W, SCALE, BIAS, NW, RES, OUT, N, K, stride_w, inv_k, eps,
                 QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
                 SILU: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program p computes out[p*BLOCK_N : (p+1)*BLOCK_N] for one activation row x [K]; SILU: gate rows
    n and up rows N + n (N is then F and W has 2F rows) → silu(gate) * up."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    acc, acc_up = _row_sums(X, W, SCALE, BIAS, NW, cols, N + cols, c_ok, K, stride_w, inv_k, eps,
                            QUANT, HAS_BIAS, NORM, SILU, INTERP, BLOCK_N, BLOCK_K, STAGES, PDL)
    y = _round(acc, ROUND, INTERP)
    if SILU:  # F.silu(g) * u on the rounded projections
        y = _silu_mul(y, _round(acc_up, ROUND, INTERP), ROUND, INTERP)
    if RESID:  # r + y, rounded, back into r
        y = _round(tl.load(RES + cols, mask=c_ok, other=0.0).to(tl.float32) + y, ROUND, INTERP)
    tl.store(OUT + cols, y.to(OUT.dtype.element_ty), mask=c_ok)


@_jit
def _rows_kernel(X, W, SCALE, BIAS, NW, RES, OUT, M, N, K, stride_x, stride_w, stride_r, stride_o, inv_k, eps,
                 QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
                 SILU: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr, SPLIT: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """2-64 activation rows: program p computes out[:, p*BLOCK_N : (p+1)*BLOCK_N] with tl.dot over tiles
    x [BLOCK_M = 16 / 32 / 64, BLOCK_K] (rows past M are zeros) · W [BLOCK_N, BLOCK_K]ᵀ, operands in DOT
    (the model dtype; float32 in the interpreter). Every program reads all M rows of x (from L2). The fused
    ops as in _gemv_kernel, per row; with the folded norm, x_k · g_k is not a DOT value: it enters as two
    (SPLIT, see _rows_tile). PDL: waits for the previous
    kernel before reading anything (no prefetch: this kernel is off by default, see skinny_configs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    xp = X + rows.to(tl.int64)[:, None] * stride_x
    p1 = W + cols.to(tl.int64)[:, None] * stride_w
    p2 = W + (N + cols).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if STAGES > 1:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc, acc2, ss = _rows_tile(xp, NW, p1, p2, r_ok, c_ok, k0, K, acc, acc2, ss, NORM, SILU, SPLIT,
                                       DOT, PRECISION, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, acc2, ss = _rows_tile(xp, NW, p1, p2, r_ok, c_ok, k0, K, acc, acc2, ss, NORM, SILU, SPLIT,
                                       DOT, PRECISION, BLOCK_K)
    _rows_epilogue(acc, acc2, ss, rows, r_ok, cols, c_ok, SCALE, BIAS, RES, OUT, N, K, stride_r, stride_o,
                   inv_k, eps, QUANT, HAS_BIAS, NORM, RESID, SILU, ROUND, INTERP)


@_jit
def _rows_epilogue(acc, acc2, ss, rows, r_ok, cols, c_ok, SCALE, BIAS, RES, OUT, N, K, stride_r, stride_o, inv_k, eps,
                   QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
                   SILU: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr):
    """The 2-8-row kernels' ending, as _gemv_kernel's per row: row sums acc (acc2: up rows) [M, BN] and
    each row's Σ x² (ss [M], with NORM) → int8 scales, norm scale, bias, rounding, SiLU·up, residual, store."""
    if QUANT:
        acc = acc * tl.load(SCALE + cols, mask=c_ok, other=0.0)[None, :]
        if SILU:
            acc2 = acc2 * tl.load(SCALE + N + cols, mask=c_ok, other=0.0)[None, :]
    if NORM:
        scale = _rms_scale(ss, K, inv_k, eps, INTERP)
        acc = acc * scale[:, None]
        acc2 = acc2 * scale[:, None]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc2 += tl.load(BIAS + N + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, ROUND, INTERP)
    if SILU:
        y = _silu_mul(y, _round(acc2, ROUND, INTERP), ROUND, INTERP)
    ok = r_ok[:, None] & c_ok[None, :]
    if RESID:
        r = tl.load(RES + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        y = _round(r.to(tl.float32) + y, ROUND, INTERP)
    tl.store(OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], y.to(OUT.dtype.element_ty), mask=ok)


@_jit
def _rows_gemv_kernel(X, W, SCALE, BIAS, NW, RES, OUT, M, N, K, stride_x, stride_w, stride_r, stride_o, inv_k, eps,
                      QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESID: tl.constexpr,
                      SILU: tl.constexpr, ROUND: tl.constexpr, INTERP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """2-8 activation rows on CUDA cores, shaped like _gemv_kernel (many programs of a few weight rows,
    long K tiles): each weight tile, loaded once, is multiplied with every row's x tile in turn (a static
    loop over BLOCK_M ≥ M rows) — M FMAs per weight element, which the bytes leave room for at M ≤ 8.
    Each row's sums are the one-row kernel's (the same tile sums in the same order); its Σ x² runs in
    another order. The weight tiles are pipelined (STAGES); PDL as in _row_sums."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    p1 = W + cols.to(tl.int64)[:, None] * stride_w
    p2 = W + (N + cols).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PDL:
        _pdl_prologue(p1, p2, c_ok, K, SILU, BLOCK_K)
    if STAGES > 1:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w, u = _weight_tile(p1, p2, c_ok, k0, K, SILU, BLOCK_K)
            acc, acc2, ss = _rows_fma_tile(X, NW, w, u, rows, M, k0, K, stride_x, acc, acc2, ss, NORM, SILU,
                                           BLOCK_M, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            w, u = _weight_tile(p1, p2, c_ok, k0, K, SILU, BLOCK_K)
            acc, acc2, ss = _rows_fma_tile(X, NW, w, u, rows, M, k0, K, stride_x, acc, acc2, ss, NORM, SILU,
                                           BLOCK_M, BLOCK_K)
    _rows_epilogue(acc, acc2, ss, rows, r_ok, cols, c_ok, SCALE, BIAS, RES, OUT, N, K, stride_r, stride_o,
                   inv_k, eps, QUANT, HAS_BIAS, NORM, RESID, SILU, ROUND, INTERP)


@_jit
def _rows_fma_tile(X, NW, w, u, rows, M, k0, K, stride_x, acc, acc2, ss, NORM: tl.constexpr, SILU: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile of _rows_gemv_kernel: the weight tile(s) w (u) [BLOCK_N, BLOCK_K] times each row's
    x[m, k0 : k0 + BLOCK_K], added into row m of acc (acc2) [BLOCK_M, BLOCK_N]."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    if NORM:
        g = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BLOCK_K], dtype=tl.float32)  # unused
    for m in tl.static_range(BLOCK_M):
        x_ok = k_ok & (tl.full([BLOCK_K], m, tl.int32) < M)  # rows past M read nothing
        x = tl.load(X + m * stride_x + ks, mask=x_ok, other=0.0).to(tl.float32)
        here = rows == m
        if NORM:
            ss = tl.where(here, ss + tl.sum(x * x, 0), ss)
            x = x * g
        acc = tl.where(here[:, None], acc + tl.sum(w * x[None, :], 1)[None, :], acc)
        if SILU:
            acc2 = tl.where(here[:, None], acc2 + tl.sum(u * x[None, :], 1)[None, :], acc2)
    return acc, acc2, ss


@_jit
def _rows_tile(xp, NW, p1, p2, r_ok, c_ok, k0, K, acc, acc2, ss, NORM: tl.constexpr, SILU: tl.constexpr,
               SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile of _rows_kernel. SPLIT: x (float32 after the folded norm) enters the 16-bit dot as
    hi + lo, two DOT values (hi = x rounded, lo = the remainder rounded): ~16 significant bits of x
    instead of 8, as exact as the one-row kernel's float32 sums to within float32 accumulation. The
    second dot costs tensor-core time only, which these memory-bound tiles have to spare."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x = tl.load(xp + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if NORM:
        ss += tl.sum(x * x, 1)
        x = x * tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    hi = x.to(DOT)
    lo = (x - hi.to(tl.float32)).to(DOT)  # unused (and dropped by the compiler) unless SPLIT
    w_ok = c_ok[:, None] & k_ok[None, :]
    w = tl.trans(_dot_operand(tl.load(p1 + ks[None, :], mask=w_ok, other=0.0), DOT))
    acc = tl.dot(hi, w, acc, input_precision=PRECISION)
    if SPLIT:
        acc = tl.dot(lo, w, acc, input_precision=PRECISION)
    if SILU:
        u = tl.trans(_dot_operand(tl.load(p2 + ks[None, :], mask=w_ok, other=0.0), DOT))
        acc2 = tl.dot(hi, u, acc2, input_precision=PRECISION)
        if SPLIT:
            acc2 = tl.dot(lo, u, acc2, input_precision=PRECISION)
    return acc, acc2, ss


@_jit
def _dot_operand(w, DOT: tl.constexpr):
    """A loaded weight tile as a dot operand of type DOT: int8 → DOT is exact (through float32); a tile
    already of type DOT is used as loaded (no conversion in between, so the loads can stream straight into
    the dot's shared-memory buffers)."""
    if w.dtype == DOT:
        return w
    return w.to(tl.float32).to(DOT)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [N, K] int8, scale [N] float32) with weight ≈ q * scale[:, None].

    scale = max |row| / 127 (rows of zeros get scale 1 and stay zero); q = round(weight / scale), so
    each weight is off by at most scale / 2."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def check_weights(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scale: torch.Tensor | None) -> bool:
    """Clear errors for weights a skinny kernel cannot read with activations x; True for int8 weights.

    weight: x's dtype (scale None), or int8 with a float32 scale per row; bias: one value per row."""
    rows = weight.shape[0]
    int8 = weight.dtype == torch.int8
    if int8:
        if scale is None or scale.shape != (rows,) or scale.dtype != torch.float32:
            raise ValueError(f"int8 weights need a float32 scale per row ({rows}), got "
                             f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
    elif weight.dtype != x.dtype:
        raise TypeError(f"x {x.dtype} and weight {weight.dtype} must share a dtype (or be int8 with scales)")
    elif scale is not None:
        raise ValueError("scale applies to int8 weights only")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match weight rows {rows}")
    return int8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           scale: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
           residual: torch.Tensor | None = None, silu_mul: bool = False,
           config: Config | None = None) -> torch.Tensor:
    """x @ weightᵀ (+ bias) for x [..., K] holding at most MAX_ROWS (64) rows, with optional fused ops.

    weight: [N, K] (or [2F, K] with silu_mul: gate rows then up rows) in x's dtype, or int8 with
    scale [N] / [2F] float32 per row (`quantize_int8`); bias: [N] / [2F].
    norm=(g, eps): x is first replaced by RMSNorm(x) with weight g [K] (in float32, not rounded to the
    dtype in between as the eager RMSNorm's output is — folded into the product, see the kernel).
    residual: [..., N] tensor of x's dtype; the result is added into it in place, and it is returned.
    silu_mul: return silu(x @ W[:F]ᵀ) * (x @ W[F:]ᵀ), [..., F].
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages) overriding the tuned table / heuristic (benchmarks;
    2-8 rows: BLOCK_N < 16 runs the CUDA-core rows kernel, ≥ 16 the tile kernel; 9-64 rows: BLOCK_N ≥ 16).
    Returns a new [..., N] (or [..., F]) tensor in x's dtype, or `residual`.
    """
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dim {K}")
    int8 = check_weights(x, weight, bias, scale)
    rnd = _rounding(x.dtype)
    N = weight.shape[0]
    if silu_mul:
        if N % 2:
            raise ValueError(f"silu_mul needs [gate; up] weights with an even row count, not {N}")
        N //= 2
    if norm is not None and norm[0].shape != (K,):
        raise ValueError(f"norm weight {tuple(norm[0].shape)} does not match K = {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.shape[0] > MAX_ROWS:
        raise ValueError(f"linear takes at most {MAX_ROWS} row(s) of activations, not {x2.shape[0]}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if residual is not None:
        if residual.shape != (*lead, N) or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} != {(*lead, N)} {x.dtype}")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous (it is updated in place)")
        out = residual
    else:
        out = torch.empty(*lead, N, device=x.device, dtype=x.dtype)
    if x2.shape[0] == 0 or N == 0:
        return out
    M = x2.shape[0]
    block_n, block_k, warps, stages = config or config_for(N, K, silu_mul, x.device, int8, M)
    if M > GEMV_ROWS and block_n < 16:
        raise ValueError(f"{M} rows take the tile kernel, whose configs have BLOCK_N ≥ 16 (got {block_n})")
    if _INTERPRET:
        stages = 1  # the interpreter runs the plain K loop (tl.range's pipelining is a compiled feature)
    nw, eps = (norm[0].contiguous(), float(norm[1])) if norm is not None else (weight, 0.0)
    use_pdl = pdl.enabled(x.device)
    if M > 1 and block_n < 16:  # CUDA-core rows (GEMV-shaped configs; tl.dot needs 16-row weight tiles)
        o2 = out.view(M, N)
        _rows_gemv_kernel[(triton.cdiv(N, block_n),)](
            x2, weight, scale if int8 else weight, bias if bias is not None else weight, nw, o2, o2, M, N, K,
            x2.stride(0), weight.stride(0), o2.stride(0), o2.stride(0), _inv(K), eps, QUANT=int8,
            HAS_BIAS=bias is not None, NORM=norm is not None, RESID=residual is not None, SILU=silu_mul,
            ROUND=rnd, INTERP=_INTERPRET, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
            STAGES=stages, PDL=use_pdl, num_warps=warps, **pdl.launch_options(use_pdl),
        )
        return out
    if M > 1:  # tensor-core tiles
        dot = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
        if _INTERPRET:
            dot = tl.float32  # the interpreter's dot treats 16-bit floats as integers
        o2 = out.view(M, N)
        _rows_kernel[(triton.cdiv(N, block_n),)](
            x2, weight, scale if int8 else weight, bias if bias is not None else weight, nw, o2, o2, M, N, K,
            x2.stride(0), weight.stride(0), o2.stride(0), o2.stride(0), _inv(K), eps, QUANT=int8,
            HAS_BIAS=bias is not None, NORM=norm is not None, RESID=residual is not None, SILU=silu_mul,
            ROUND=rnd, INTERP=_INTERPRET, SPLIT=norm is not None and dot != tl.float32, DOT=dot,
            PRECISION="ieee" if dot == tl.float32 else "tf32",
            BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
            PDL=use_pdl, num_warps=warps,
            **pdl.launch_options(use_pdl),
        )
        return out
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, weight, scale if int8 else weight, bias if bias is not None else weight, nw, out, out, N, K,
        weight.stride(0), _inv(K), eps, QUANT=int8, HAS_BIAS=bias is not None, NORM=norm is not None,
        RESID=residual is not None, SILU=silu_mul,
        ROUND=rnd, INTERP=_INTERPRET, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=use_pdl,
        num_warps=warps, **pdl.launch_options(use_pdl),
    )
    return out
