"""Triton flash attention for long prefill chunks over the paged KV cache.

What it computes — the reference path (`reference.read_kv` + `reference.attention`) for the plain
prefill forward: no context view, no observer, no pending tokens, no new-token mask. Row b has
L_b = lengths[b] context tokens in cache slots [0, L_b) and T new tokens whose K/V the forward has already
written at slots L_b + t (`Attention.attend` writes before it attends); query t of row b sees

    slots [0, L_b + t]                               (causal: the context and new tokens up to itself),
    but none of [0, L_b) when live[b] == 0           (a finished row: only its new tokens),
    and only slots s with q_positions[b, t] - s < W  (a sliding window W: Mistral; applied only when both
                                                      are given, as in the reference).

Every row has the same T (the metadata has one `num_new`): the Engine's batched prefill
(`engine.prefill.prefill_rows`) right-pads shorter chunks, and a padding token of row b is an ordinary
query here — it sees slots up to L_b + t, which hold the row's own scratch K/V (its own pages past its
chunk, or the shared trash page: finite values, possibly another row's), exactly as in the reference.
Its output is discarded; real tokens never see padding keys (they come after them). So the kernel needs
no per-row token count, and none is passed.

Design (flash-attention forward with the decode kernel's GQA packing and paging):
  * One program per (m-tile, b * Hkv + kv head). The G = Hq / Hkv query heads of a KV head and the T new
    tokens are packed into tile rows m = t * G + g (as in triton_decode), so each K/V tile is read once
    for all G heads. A tile of BLOCK_M rows spans tokens [t_lo, t_hi] (BLOCK_M need not be a multiple
    of G: a token's heads may straddle two tiles). m-tiles run in reverse order (the heaviest, most
    causal keys, first), and consecutive programs share a KV head (its K/V stay in L2).
  * One loop over key slots [lo, L_b + t_hi + 1) in BLOCK_N tiles — the context and the causal new keys
    are one range of slots, so the boundary at L_b costs no partial tile. Three pieces:
        [lo, a)  masked: keys before the window (or hidden context) for some of the tile's rows;
        [a, b)   unmasked: visible to every row (no mask, no `where`, unmasked loads);
        [b, hi)  masked: the diagonal — keys past L_b + t_lo (tiles above the diagonal of the whole tile,
                 s > L_b + t_hi, are never visited).
    lo is tile-aligned, so every tile starts at a multiple of BLOCK_N: where page_size is a multiple
    of BLOCK_N a tile lies in one page — one block-table lookup per tile (issued one tile ahead in the
    unmasked loop, as triton_decode's "prefetch", which reads at about the dense time there); other page sizes
    (a dense cache: page_size = capacity) look up each key's page.
  * Online softmax in base 2 (scores scaled by log2(e)/sqrt(D) in fp32), fp32 accumulation; P is
    rounded to V's dtype for the PV product (16-bit inputs), fp32 inputs use IEEE dots. Every real row
    sees at least its own key; rows that see none (padding rows of the last tile) output 0, never NaN.
  * Masked loads (other = 0) wherever a key may be invisible to every row of the tile: slots past
    L_b + t_hi (stale scratch) and hidden context (live 0) are never read.

Output [B, T, Hq, D] contiguous, q's dtype (what `Attention.attend_rotated` reshapes to [B, T, Hq * D]).

triton is imported guarded (`redwood.kernels.triton_import`): without it this module imports and
`available` says False. Under TRITON_INTERPRET=1 the kernel runs in Triton's CPU interpreter, whose tl.dot
mishandles bf16: there bf16 tiles are upcast to fp32 after loading (as in triton_decode).
"""

from __future__ import annotations

import functools
import math

import torch

from redwood.kernels.triton_import import INTERPRET as _INTERPRET
from redwood.kernels.triton_import import jit as _jit
from redwood.kernels.triton_import import tl, triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# Kernel


@_jit
def _tile(acc, m_i, l_i, q, K, V, k_base, v_base, bt_row, page, j0, offs_n, offs_d, d_ok,
          L, t, ctx_lo, qpos, key_lo, hi, qk_scale, window, page_size, sbt_w, sk_b, sk_n, sk_d, sv_b, sv_n, sv_d,
          MASKED: tl.constexpr, FULL_D: tl.constexpr, PAGE_TILES: tl.constexpr, HAS_LIVE: tl.constexpr,
          HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over the key tile of slots s = j0 + offs_n [BN].

    acc [BM, BD] fp32, m_i / l_i [BM] fp32 (base-2 running max / sum), q [BM, BD]. page: the tile's
    physical page (PAGE_TILES: the tile lies in one page), else looked up per key here. MASKED: apply
    the causal / hidden-context / window mask and load only keys in [key_lo, hi); unmasked tiles are
    visible to every row of the tile and loaded without a key mask.
    """
    s_idx = j0 + offs_n
    if MASKED:
        key_ok = (s_idx >= key_lo) & (s_idx < hi)
    if PAGE_TILES:
        within = s_idx - (j0 // page_size) * page_size
        k_rows = k_base + page * sk_b + within[:, None] * sk_n
        v_rows = v_base + page * sv_b + within[:, None] * sv_n
    else:  # each key's page: slot s at page bt_row[s // page_size], offset s % page_size
        if MASKED:
            pg = tl.load(bt_row + (s_idx // page_size) * sbt_w, mask=key_ok, other=0).to(tl.int64)
        else:
            pg = tl.load(bt_row + (s_idx // page_size) * sbt_w).to(tl.int64)
        within = s_idx % page_size
        k_rows = k_base + pg[:, None] * sk_b + within[:, None] * sk_n
        v_rows = v_base + pg[:, None] * sv_b + within[:, None] * sv_n
    k_ptr = k_rows + offs_d[None, :] * sk_d
    v_ptr = v_rows + offs_d[None, :] * sv_d
    if MASKED:
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr, mask=kv_mask, other=0.0)
    elif FULL_D:  # BLOCK_D == D: no mask at all, 16-byte loads
        k = tl.load(k_ptr)
        v = tl.load(v_ptr)
    else:
        k = tl.load(k_ptr, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptr, mask=d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's tl.dot treats bf16 (held as uint16) as integers: dot in fp32
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BM, BN], base-2 logits
    if MASKED:
        visible = s_idx[None, :] <= L + t[:, None]  # causal (slots past hi are past every row's)
        if HAS_LIVE:
            visible = visible & (s_idx[None, :] >= ctx_lo)
        if HAS_WINDOW:
            visible = visible & (qpos[:, None] - s_idx[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite (-1e30): a fully masked row gives p = 0
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def _prefill_kernel(
    Q, K, V, LENGTHS, LIVE, QPOS, BLOCK_TABLE, OUT,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    sp_b, sp_t,
    sbt_b, sbt_w, page_size,
    qk_scale, window, Hkv, T,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_LIVE: tl.constexpr, PAGE_TILES: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    mt = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest tiles (most causal keys) first
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)  # int64: offsets into a large cache / output pass 2^31
    kvh = bh % Hkv
    Hq = Hkv * G

    # Rows of this tile: m = t * G + g → new token t, query head kvh * G + g.
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // G
    hq = kvh * G + offs_m % G
    row_ok = t < T
    t_lo = (mt * BLOCK_M) // G
    t_hi = tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    FULL_D: tl.constexpr = BLOCK_D == D
    if FULL_D:
        d_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_ok = offs_d < D

    q = tl.load(Q + b * sq_b + hq[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    L = tl.load(LENGTHS + b).to(tl.int32)
    k_base = K + kvh * sk_h  # K/V [pages, Hkv, page_size, D]
    v_base = V + kvh * sv_h
    bt_row = BLOCK_TABLE + b * sbt_b

    # The first slot any row of the tile sees (key_lo) and the first every row sees (all_lo).
    ctx_lo = 0
    if HAS_LIVE:  # a finished row sees none of its context
        ctx_lo = tl.where(tl.load(LIVE + b) != 0, 0, L)
    key_lo = ctx_lo
    all_lo = ctx_lo
    qpos = t  # (unused without a window)
    if HAS_WINDOW:  # row t sees slots s > qpos - window
        qpos = tl.load(QPOS + b * sp_b + t * sp_t, mask=row_ok, other=0).to(tl.int32)
        first = qpos - window + 1
        key_lo = tl.maximum(key_lo, tl.min(tl.where(row_ok, first, 2147483647), 0))
        all_lo = tl.maximum(all_lo, tl.max(tl.where(row_ok, first, -2147483647), 0))
    hi = L + t_hi + 1  # past the last row's own slot: tiles above the diagonal are never visited
    key_lo = tl.minimum(tl.maximum(key_lo, 0), hi)
    lo = (key_lo // BLOCK_N) * BLOCK_N
    a = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(all_lo, 0), BLOCK_N) * BLOCK_N, lo), hi)
    bnd = tl.minimum(tl.maximum(((L + t_lo + 1) // BLOCK_N) * BLOCK_N, a), hi)  # tiles ≤ L + t_lo: all rows

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles never give inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # [lo, a): leading keys some rows do not see (window start, hidden context)
    for j0 in range(lo, a, BLOCK_N):
        page = 0
        if PAGE_TILES:
            page = tl.load(bt_row + (j0 // page_size) * sbt_w).to(tl.int64)
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, k_base, v_base, bt_row, page, j0, offs_n, offs_d, d_ok,
                              L, t, ctx_lo, qpos, key_lo, hi, qk_scale, window, page_size, sbt_w,
                              sk_b, sk_n, sk_d, sv_b, sv_n, sv_d, True, FULL_D, PAGE_TILES, HAS_LIVE, HAS_WINDOW,
                              UPCAST, PRECISION)
    # [a, bnd): keys every row of the tile sees — the bulk of a long context. The next tile's page is
    # loaded one step ahead, so its latency hides behind the current tile.
    next_page = 0
    if PAGE_TILES:
        next_page = tl.load(bt_row + (a // page_size) * sbt_w, mask=a < bnd, other=0).to(tl.int64)
    for j0 in range(a, bnd, BLOCK_N):
        page = next_page
        if PAGE_TILES:
            j1 = j0 + BLOCK_N
            next_page = tl.load(bt_row + (j1 // page_size) * sbt_w, mask=j1 < bnd, other=0).to(tl.int64)
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, k_base, v_base, bt_row, page, j0, offs_n, offs_d, d_ok,
                              L, t, ctx_lo, qpos, key_lo, hi, qk_scale, window, page_size, sbt_w,
                              sk_b, sk_n, sk_d, sv_b, sv_n, sv_d, False, FULL_D, PAGE_TILES, HAS_LIVE, HAS_WINDOW,
                              UPCAST, PRECISION)
    # [bnd, hi): the diagonal — keys past some rows' own slot
    for j0 in range(bnd, hi, BLOCK_N):
        page = 0
        if PAGE_TILES:
            page = tl.load(bt_row + (j0 // page_size) * sbt_w).to(tl.int64)
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, k_base, v_base, bt_row, page, j0, offs_n, offs_d, d_ok,
                              L, t, ctx_lo, qpos, key_lo, hi, qk_scale, window, page_size, sbt_w,
                              sk_b, sk_n, sk_d, sv_b, sv_n, sv_d, True, FULL_D, PAGE_TILES, HAS_LIVE, HAS_WINDOW,
                              UPCAST, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key (padding rows) → 0
    row = (b * T + t) * Hq + hq  # row (b, t, hq) of the output [B, T, Hq, D]
    tl.store(OUT + row[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------------
# Host side


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs for this device / dtype / head dim (else the caller uses the reference)."""
    device = torch.device(device)
    if triton is None or _INTERPRET or device.type != "cuda" or not torch.cuda.is_available():
        return False
    if dtype not in _DTYPES or not 1 <= head_dim <= _MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)  # bf16 tl.dot, enough shared memory


@functools.lru_cache(maxsize=None)
def _big_shared_memory(device: torch.device) -> bool:
    """sm_80 / sm_90 (A100, H100, H200): ≥ 164 KB of shared memory per SM, room for 3 K/V stages."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in ((8, 0), (9, 0))


def launch_config(D: int, dtype: torch.dtype, big_smem: bool = False) -> dict:
    """Block sizes and launch options from static shapes: the flash-attention forward's usual
    Hopper/Ampere choice for 16-bit operands at D ≤ 128 — 128 query rows × 64 keys per step, 8 warps
    (two warpgroups of 64 rows), 3 stages where shared memory allows (q 32 KB + 3 × (K + V) 32 KB =
    128 KB at D = 128). On the H200 (prefill_bench.py --sweep) it was the fastest of the tilings swept
    in every case (docs/perf/engine.md, session 13). Compiled for sm_90 (docs/perf/attention.md,
    session 12): bf16 D = 128 fits its registers without spills and uses wgmma; 128 × 128 tiles spill,
    as do 4-warp 128-row tiles. D > 128: 64 × 32, 8 warps (no
    spill at D = 256). fp32 (tests; not a speed path: its IEEE dots are FMA loops that spill at
    D = 128 whatever the tile): 64 × 32 × 8 warps at D ≤ 64 (no spill),
    32 × 16 × 4 warps above (the least spilled)."""
    block_d = max(16, triton.next_power_of_2(D))
    if dtype == torch.float32:
        if block_d <= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=2)
        return dict(BLOCK_M=32, BLOCK_N=16, BLOCK_D=block_d, num_warps=4, num_stages=2)
    if block_d > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=3 if big_smem else 2)


def prefill_attention(q, k_cache, v_cache, lengths, block_table, *, q_positions=None, sliding_window=None,
                      live=None, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T new tokens per row over one layer of the paged KV cache (see the module
    docstring for exactly which keys each query sees).

    q: [B, Hq, T, D] rotated queries (any strides; `fused.rope_and_write` returns a transposed view);
    k_cache, v_cache: one layer [pages, Hkv, page_size, D] (any strides), the new tokens' K/V already at
    slots L_b + t; lengths: [B] int on the device (never read on the host); block_table: [B, W]
    int32/int64 on the device, logical slot s of row b at page block_table[b, s // page_size], covering
    every slot the call reads (s < L_b + T); None → the dense layout [B, Hkv, capacity, D] (the table
    arange(B)[:, None], page_size = capacity). q_positions [B, T] + sliding_window: the window (applies
    only with both, as in the reference). live: [B] 0/1 or None (all live). config: override
    `launch_config`'s BLOCK_M / BLOCK_N / num_warps / num_stages (tests, benchmarks). out: a contiguous
    [B, T, Hq, D] tensor of q's dtype to write (tests poison it), None → a new one.
    Returns [B, T, Hq, D] contiguous, q's dtype (`out` when given).
    """
    B, Hq, T, D = q.shape
    P, Hkv, page_size, Dk = k_cache.shape
    assert T >= 1, "no new tokens"
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, "shape mismatch"
    assert q.dtype in _DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "dtype mismatch"
    assert D <= _MAX_HEAD_DIM, f"head dim {D} > {_MAX_HEAD_DIM}"
    if block_table is None:
        assert P == B, f"dense caches {tuple(k_cache.shape)}: want [B = {B}, Hkv, capacity, D]"
        block_table = torch.arange(B, dtype=torch.int32, device=q.device)[:, None]
    assert block_table.dim() == 2 and block_table.shape[0] == B, \
        f"block_table {tuple(block_table.shape)} != [B = {B}, W]"
    assert block_table.dtype in (torch.int32, torch.int64), f"block_table dtype {block_table.dtype}"
    assert block_table.device == q.device == k_cache.device == lengths.device, "tensors on different devices"
    has_window = sliding_window is not None and q_positions is not None
    if has_window:
        assert q_positions.shape == (B, T), f"q_positions {tuple(q_positions.shape)} != [B, T] = {(B, T)}"
    G = Hq // Hkv
    cfg = launch_config(D, q.dtype, _big_shared_memory(q.device))
    if config:
        cfg.update(config)
    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16, "tl.dot needs tiles of ≥ 16"
    if out is None:
        out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    assert out.shape == (B, T, Hq, D) and out.dtype == q.dtype and out.is_contiguous(), "bad out"
    upcast = _INTERPRET and q.dtype == torch.bfloat16
    qp, qp_strides = (q_positions, q_positions.stride()) if has_window else (lengths, (0, 0))
    grid = (triton.cdiv(G * T, cfg["BLOCK_M"]), B * Hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, lengths, live if live is not None else lengths, qp, block_table, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *qp_strides, *block_table.stride(), page_size,
        _LOG2E / math.sqrt(D), sliding_window if has_window else 0, Hkv, T,
        G=G, D=D, HAS_WINDOW=has_window, HAS_LIVE=live is not None,
        PAGE_TILES=page_size % cfg["BLOCK_N"] == 0, UPCAST=upcast,
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", **cfg)
    return out
