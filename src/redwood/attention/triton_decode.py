"""Triton attention over a KV cache for decode, chain-verify and tree-verify steps (few new tokens).

Same semantics as `reference.read_kv` + `reference.attention` (see reference.py for the slot layout):
query t of row b sees
    context   slots [0, L_b), or through a view the slots ctx_idx[b, h, c] where ctx_valid[b, h, c],
              or through a span view (StreamingLLM's) the slots [0, sinks) and [S_b - window, S_b) of [0, L_b)
              (S_b: the lengths the view was taken at);
    recent    slots L_b + r, r in [0, P + T), where new_mask[t, r] (None: r <= P + t);
    and, with a sliding window, only slots s with q_positions[b, t] - s < window.

Design (flash-decoding with GQA packing):
  * One program per (m-tile, split, b * Hkv + kv head). The G = Hq / Hkv query heads of a KV head and
    the T new tokens of the row are packed into the M rows of one tile (row m = t * G + g), so each
    K/V tile is read once for all of them and QK^T is a real matrix product even at T = 1.
  * Split-KV: the context keys of a row are cut into `num_splits` chunks, one program each; every
    program writes a partial (running max, running sum, unnormalised acc) to a fp32 workspace and a
    second kernel merges them. The chunk size is computed in the kernel from
    the row's length, so the host never reads `lengths`; the recent keys (P + T of them) go to the
    last split.
  * num_splits is chosen on the host from static shapes only (capacity or C, B, Hkv, SM count), so a
    call has no host sync and allocates only from shapes: it can be captured in a CUDA graph.
  * Paged caches: K/V are [pages, Hkv, page_size, D] and a block table [B, W] maps row b's logical
    page j to a physical one (read in the kernel, like the lengths). Slots stay logical everywhere
    (lengths, views, windows, the recent keys); only the K/V loads translate them. A context tile starts
    at a multiple of BLOCK_N, so where page_size is one too it lies in one page: one table lookup per
    tile, loaded a tile ahead, then the same contiguous [BLOCK_N, D] loads as the dense layout (about the
    dense time, bit-identical). A span view walks the same aligned tiles over its two ranges, the slots
    between them skipped whole and the rest of a straddling tile masked (masked rows are never loaded).
    Other page sizes, gathered views and the recent keys look up each key's
    page (each key's D values are still contiguous; context tiles read that way are slower, most for
    several new tokens; the table: docs/perf/attention.md, session 10). Without a table the cache is
    dense [B, Hkv, capacity, D] and the kernel is the unpaged variant.
  * Online softmax in base 2, fp32 accumulation; rows that see no key output 0 (never NaN).

triton is imported guarded (`redwood.kernels.triton_import`): without it this module still imports, and
`supported` / `available` say False (the caller then uses the reference).
Under TRITON_INTERPRET=1 (read when this module is imported) the kernels run in Triton's CPU
interpreter, whose tl.dot mishandles bf16 — there bf16 tiles are upcast to fp32 after loading.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from redwood.kernels import occupancy, pdl
from redwood.kernels.triton_import import INTERPRET as _INTERPRET
from redwood.kernels.triton_import import jit as _jit
from redwood.kernels.triton_import import tl, triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# Kernels


@_jit
def _softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step over a key tile.

    acc [BM, BD] fp32, m_i / l_i [BM] fp32 (base-2 running max / sum), q [BM, BD], k / v [BN, BD],
    visible [BM, BN] bool. Masked scores are -inf and m_i stays finite, so p = 0 there, never NaN.
    PRECISION: "ieee" for fp32 operands (not tf32); ignored for 16-bit ones.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def _kv_rows(k_base, v_base, bt_row, slot, ok, sbt_w, page_size, sk_b, sk_n, sv_b, sv_n, PAGED: tl.constexpr):
    """Pointers [N, 1] to the K and V rows of logical slots `slot` [N] (read where ok): through the block
    table (one lookup per key) when PAGED, else slot-strided from the row's base."""
    if PAGED:
        page = tl.load(bt_row + (slot // page_size) * sbt_w, mask=ok, other=0).to(tl.int64)
        within = slot % page_size
        return (k_base + page[:, None] * sk_b + within[:, None] * sk_n,
                v_base + page[:, None] * sv_b + within[:, None] * sv_n)
    return k_base + slot[:, None] * sk_n, v_base + slot[:, None] * sv_n


@_jit
def _span_slot(x, gap_lo, shift, HAS_SPAN: tl.constexpr):
    """The first slot of the context tile at position x of this split's range: x itself, or with a span view
    x + shift past the sinks' tiles (gap_lo, shift: multiples of BLOCK_N)."""
    if HAS_SPAN:
        return x + tl.where(x >= gap_lo, shift, 0)
    return x


@_jit
def _split_kv_kernel(
    Q, K, V, LENGTHS, LIVE, NEW_MASK, CTX_IDX, CTX_VALID, QPOS, BLOCK_TABLE, OUT, WS_ACC, WS_M, WS_L, LOCKS,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_n, sk_d,
    sv_b, sv_h, sv_n, sv_d,
    snm_b, snm_t, snm_w,
    sci_b, sci_h, sci_c,
    scv_b, scv_h, scv_c,
    sp_b, sp_t,
    sbt_b, sbt_w, page_size,
    qk_scale, window, Hkv, T, P, C, span_sinks, span_recent, num_splits,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VIEW: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_NEW_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_LIVE: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr, PREFETCH: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # redwood.kernels.pdl: everything here depends on earlier kernels (q, the cache): wait first
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    mt = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // Hkv).to(tl.int64)  # int64: batch offsets into a large cache can pass 2^31
    kvh = bh % Hkv
    Hq = Hkv * G

    # Rows of this tile: m = t * G + g → new token t, query head kvh * G + g.
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // G
    hq = kvh * G + offs_m % G
    row_ok = t < T
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:  # a constant mask keeps the loads vectorised
        d_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_ok = offs_d < D

    q = tl.load(Q + b * sq_b + hq[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's tl.dot treats bf16 (held as uint16) as integers: dot in fp32
        q = q.to(tl.float32)
    L = tl.load(LENGTHS + b).to(tl.int32)
    if PAGED:  # K/V [pages, Hkv, page_size, D]: slot s of row b is at page BLOCK_TABLE[b, s // page_size]
        k_base = K + kvh * sk_h
        v_base = V + kvh * sv_h
        bt_row = BLOCK_TABLE + b * sbt_b
    else:  # K/V [B, Hkv, capacity, D]: row b's slot s
        k_base = K + b * sk_b + kvh * sk_h
        v_base = V + b * sv_b + kvh * sv_h
        bt_row = BLOCK_TABLE  # unused
    if HAS_WINDOW:
        qpos = tl.load(QPOS + b * sp_b + t * sp_t, mask=row_ok, other=0).to(tl.int32)

    # This split's share [lo, hi) of the context keys (cache slots, or entries of the view; with a span
    # view, positions in the span's tiles: x < gap_lo is slot x, x ≥ gap_lo slot x + shift).
    start = 0
    gap_lo = 0
    shift = 0
    if HAS_VIEW:
        n_ctx = C
    elif HAS_SPAN:  # slots [0, sink_end) and [rec_lo, S) of the S the view was taken at (CTX_IDX: its lengths)
        S = tl.minimum(tl.load(CTX_IDX + b * sci_b).to(tl.int32), L)
        sink_end = tl.minimum(span_sinks, S)
        rec_lo = tl.maximum(S - span_recent, span_sinks)  # a recent slot below the sinks is one of them
        gap_lo = tl.cdiv(sink_end, BLOCK_N) * BLOCK_N  # the sinks' tiles end here …
        gap_hi = tl.maximum((rec_lo // BLOCK_N) * BLOCK_N, gap_lo)  # … the recent slots' tiles start here
        shift = gap_hi - gap_lo
        n_ctx = tl.where(S <= gap_lo, S, S - shift)
    else:
        n_ctx = L
    if HAS_LIVE:  # a finished row reads none of its context
        n_ctx = n_ctx * tl.load(LIVE + b).to(tl.int32)
    if not HAS_VIEW and not HAS_SPAN:
        if HAS_WINDOW:  # keys before the window of every row of the tile are skipped outright
            lowest = tl.min(tl.where(row_ok, qpos, 2147483647), 0) - window + 1
            start = tl.minimum((tl.maximum(lowest, 0) // BLOCK_N) * BLOCK_N, n_ctx)
    chunk = tl.cdiv(tl.cdiv(n_ctx - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, n_ctx)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles never give inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if PAGE_TILES and PREFETCH:  # the first tile's page; each step loads the next one's
        next_page = tl.load(bt_row + (_span_slot(lo, gap_lo, shift, HAS_SPAN) // page_size) * sbt_w, mask=lo < hi,
                            other=0).to(tl.int64)
    for x0 in range(lo, hi, BLOCK_N):  # context keys: visible to every row (but for the window)
        j0 = _span_slot(x0, gap_lo, shift, HAS_SPAN)
        j = j0 + tl.arange(0, BLOCK_N)
        if HAS_SPAN:  # the span's two ranges; the slots of a straddling tile outside them are never loaded
            key_ok = (x0 + tl.arange(0, BLOCK_N) < hi) & ((j < sink_end) | (j >= rec_lo))
        else:
            key_ok = j < hi
        if HAS_VIEW:
            ci = b * sci_b + kvh * sci_h + j * sci_c
            cv = b * scv_b + kvh * scv_h + j * scv_c
            key_ok = key_ok & (tl.load(CTX_VALID + cv, mask=key_ok, other=0) != 0)
            slot = tl.where(key_ok, tl.load(CTX_IDX + ci, mask=key_ok, other=0).to(tl.int32), 0)
        else:
            slot = j
        kv_mask = key_ok[:, None] & d_ok[None, :]
        if PAGE_TILES:  # the tile [j0, j0 + BLOCK_N) lies in one page (j0 and page_size: multiples of BLOCK_N)
            if PREFETCH:
                page = next_page
                x1 = x0 + BLOCK_N
                j1 = _span_slot(x1, gap_lo, shift, HAS_SPAN)
                next_page = tl.load(bt_row + (j1 // page_size) * sbt_w, mask=x1 < hi, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row + (j0 // page_size) * sbt_w).to(tl.int64)
            within = slot - (j0 // page_size) * page_size
            k_ptr = k_base + page * sk_b + within[:, None] * sk_n
            v_ptr = v_base + page * sv_b + within[:, None] * sv_n
        else:
            k_ptr, v_ptr = _kv_rows(k_base, v_base, bt_row, slot, key_ok, sbt_w, page_size, sk_b, sk_n, sv_b, sv_n,
                                    PAGED)
        k = tl.load(k_ptr + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        visible = key_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (qpos[:, None] - slot[None, :] < window)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION)

    # Recent keys (pending + new, slots L + r): only the last split reads them.
    W = P + T
    w_end = tl.where(split == num_splits - 1, W, 0)
    for r0 in range(0, w_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        key_ok = r < W
        slot = L + r
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k_ptr, v_ptr = _kv_rows(k_base, v_base, bt_row, slot, key_ok, sbt_w, page_size, sk_b, sk_n, sv_b, sv_n, PAGED)
        k = tl.load(k_ptr + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        pair_ok = row_ok[:, None] & key_ok[None, :]
        if HAS_NEW_MASK:  # bit r % 64 of word r // 64 of row t (a tile of BLOCK_R <= 64 keys is in one word)
            word = tl.load(NEW_MASK + b * snm_b + t * snm_t + (r0 // 64) * snm_w, mask=row_ok, other=0)
            bit = (word[:, None] >> (r % 64).to(tl.int64)[None, :]) & 1
            visible = pair_ok & (bit != 0)
        else:  # all pending tokens, causal among the new ones
            visible = pair_ok & (r[None, :] <= P + t[:, None])
        if HAS_WINDOW:
            visible = visible & (qpos[:, None] - slot[None, :] < window)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, PRECISION)

    # Row (b, t, hq) of the output [B, T, Hq, D] / of the workspace [B, T, Hq, num_splits(, D)].
    row = (b * T + t) * Hq + hq
    st_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        ws = row * num_splits + split
        tl.store(WS_ACC + ws[:, None] * D + offs_d[None, :], acc, mask=st_mask)
        tl.store(WS_M + ws, m_i, mask=row_ok)
        tl.store(WS_L + ws, l_i, mask=row_ok)
        if FUSED_MERGE:  # the tile's last split to finish merges all of them: no second kernel
            tl.debug_barrier()  # every thread's partials are written before the count is released
            tile = bh * tl.num_programs(0) + mt
            arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")  # once per program
            if arrived == num_splits - 1:
                out = _merge_partials(WS_ACC, WS_M, WS_L, row, row_ok, offs_d, d_ok, num_splits, D, BLOCK_S)
                tl.store(OUT + row[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=st_mask)
                tl.store(LOCKS + tile, 0)  # zero again for the next launch (or graph replay)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key → acc = 0 → 0
        tl.store(OUT + row[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=st_mask)


@_jit
def _merge_partials(WS_ACC, WS_M, WS_L, rows, r_ok, offs_d, d_ok, num_splits, D: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Combine the num_splits (≤ BLOCK_S) partials — running max m, sum l, unnormalised acc — of output
    rows `rows` [R] (valid where r_ok) → [R, BLOCK_D] fp32; the same sums wherever it runs. Loads bypass
    L1 (.cg): inside the split kernel the partials come from other programs of the same launch."""
    s = tl.arange(0, BLOCK_S)
    ml = rows[:, None] * num_splits + s[None, :]  # [R, BS]
    ml_mask = r_ok[:, None] & (s < num_splits)[None, :]
    m = tl.load(WS_M + ml, mask=ml_mask, other=-1.0e30, cache_modifier=".cg")  # as empty splits: finite, l = 0
    m_max = tl.max(m, 1)
    l = tl.load(WS_L + ml, mask=ml_mask, other=0.0, cache_modifier=".cg")
    l_tot = tl.sum(tl.exp2(m - m_max[:, None]) * l, 1)
    mask = r_ok[:, None] & d_ok[None, :]
    acc = tl.zeros([rows.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for i in range(num_splits):
        ws = rows * num_splits + i
        w = tl.exp2(tl.load(WS_M + ws, mask=r_ok, other=-1.0e30, cache_modifier=".cg") - m_max)
        acc += w[:, None] * tl.load(WS_ACC + ws[:, None] * D + offs_d[None, :], mask=mask, other=0.0,
                                    cache_modifier=".cg")
    return acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]  # no visible key anywhere → 0


@_jit
def _merge_kernel(WS_ACC, WS_M, WS_L, OUT, n_rows, num_splits,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr):
    """Combine the num_splits partials of BLOCK_R output rows (b, t, hq) into OUT [n_rows, D]."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    out = _merge_partials(WS_ACC, WS_M, WS_L, rows, r_ok, offs_d, d_ok, num_splits, D, BLOCK_S)
    mask = r_ok[:, None] & d_ok[None, :]
    tl.store(OUT + rows[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Host side


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs for this device / dtype / head dim (else use the reference)."""
    device = torch.device(device)
    if triton is None or _INTERPRET or device.type != "cuda" or not torch.cuda.is_available():
        return False
    if dtype not in _DTYPES or not 1 <= head_dim <= _MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)  # bf16 tl.dot, enough shared memory


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention(q, k_cache, ...)` can run here (CUDA, triton, dtype, head dim)."""
    return (q.device == k_cache.device and q.dtype == k_cache.dtype and q.shape[-1] == k_cache.shape[-1]
            and available(q.device, q.dtype, q.shape[-1]))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: few, large programs
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _big_shared_memory(device: torch.device) -> bool:
    """sm_80 / sm_90 (A100, H100, H200): ≥ 164 KB of shared memory per SM, room for 3 K/V stages."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in ((8, 0), (9, 0))


def _launch_config(M: int, D: int, dtype: torch.dtype, big_smem: bool = False, n_keys: int | None = None,
                   view: bool = False) -> dict:
    """Block sizes and launch options, from static shapes (chosen on an H200 with attention_bench.py;
    the figures: docs/perf/attention.md, session 7).

    BLOCK_M: the G*T packed rows: 16 (tl.dot's minimum) for ≤ 16 rows, else 64 — larger M (big trees)
    tiles over M, and adjacent M tiles share the K/V tile through L2. At long contexts the 64-row tiles
    read K/V at the floor for causal chains and small trees where 32-row ones fell short of it; 128
    rows with 8 warps was slower for trees.
    BLOCK_N: 64 context keys per step (32 where the K/V tiles would be large: fp32 or D > 128).
    BLOCK_R: keys per step over the pending + new tokens, ≤ 64 so that a tile's tree-mask bits lie
    in one int64 word (pack_new_mask).
    num_stages: 3 for 64-row tiles where shared memory allows (the compute-heavier tree and T = 8
    steps gain from the deeper pipeline), and for short contexts (n_keys, the static bound on a row's
    context keys, < 2048, as a batch-64 draft level through a short cache); else 2 (decode at T ≤ 2
    over long contexts is at the HBM floor either way, with more programs per SM).
    A gathered view (view=True: the self-draft's StreamingLLM / SnapKV index view) at ≤ 16 packed rows in
    16-bit dtypes at D ≤ 128 takes 128-key tiles in one stage instead: each of its keys is three dependent
    loads (ctx_idx, the block table, the row), and the wider tile puts twice as many of them in flight per
    step (an H100, session 32: 23.5 vs 29.9 µs a layer at batch 64 through a 512-key view, 11.2 vs 15.8 at
    batch 16; 2 stages equal at 64, slower at 16; 8 warps slower).
    """
    block_d = max(16, triton.next_power_of_2(D))
    block_m = 16 if M <= 16 else 64
    block_n = 32 if (dtype == torch.float32 or block_d > 128) else 64
    deep = block_m == 64 or (n_keys is not None and n_keys < 2048)
    stages = 3 if (big_smem and deep and block_n * block_d <= 64 * 128 and dtype != torch.float32) else 2
    if view and block_m == 16 and block_n == 64:
        block_n, stages = 128, 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=min(block_n, 64), BLOCK_D=block_d, num_warps=4,
                num_stages=stages)


# The fewest keys a split keeps (default_num_splits' min_split_keys): contiguous context keys stream, so a
# split needs many to pay for its merge; a gathered view's keys are each three dependent loads. A span view's
# tiles stream like a contiguous cache's, so it keeps SPLIT_KEYS: 64 rows of 512 contiguous keys ran fastest as
# one split (an H200, session 8: 14.5 µs; 2 / 4 / 8 splits 16.6 / 19.1 / 22.0).
SPLIT_KEYS = 1024
VIEW_SPLIT_KEYS = 128


def default_num_splits(n_keys: int, programs: int, num_sms: int, block_m: int = 64,
                       per_sm: int | None = None, min_split_keys: int = SPLIT_KEYS, block_n: int = 64) -> int:
    """Splits of the context that fill whole waves of the GPU (flash-decoding's heuristic).

    n_keys: a static bound on a row's context keys (cache capacity, or C with a view) — never the
    lengths themselves, so the call stays graph-capturable. programs: B * Hkv * M tiles. per_sm: the
    compiled kernel's resident programs per SM (redwood.kernels.occupancy); None → the estimate of 2
    programs of 64 rows, 3 of ≤ 32 rows. A last, partial wave costs about as much as a full one
    (docs/perf/attention.md, "Figures cited from the source"), so take the fewest splits whose
    waves are ≥ 95% full — or, if none is, the best filled. Each split keeps ≥ min_split_keys keys of
    the bound (short rows just leave later splits empty); at most 64 splits. Contiguous keys stream
    fast enough that a split needs ≥ `SPLIT_KEYS` (1024) of them to pay for its merge; a gathered view
    (every key its own dependent loads: ctx_idx, the block table, the row) passes `VIEW_SPLIT_KEYS`.
    A grid that fills ≤ 1/8 of the GPU (batch 1-4) is latency-bound instead: its few programs walk
    their keys one tile after another. There the context splits into up to 8 pieces of ≥ 64 keys even
    when short (docs/perf/attention.md, session 7, attempt 17).
    The kernel rounds a split's keys up to whole key tiles (block_n), so only counts whose splits all
    hold keys are considered (512 keys in 128-key tiles: 1, 2 or 4 splits — 3 would leave one empty,
    a program launched for nothing that the wave arithmetic would count as work).
    """
    slots = num_sms * (per_sm or (3 if block_m <= 32 else 2))
    max_splits = max(1, min(64, n_keys // min_split_keys))

    def holding(s: int) -> int:  # splits that hold keys when `s` are asked for (the kernel's chunking)
        chunk = triton.cdiv(triton.cdiv(n_keys, s), block_n) * block_n
        return triton.cdiv(n_keys, chunk) if n_keys > 0 else 1

    def filled(s: int) -> float:
        waves = programs * s / slots
        return waves / math.ceil(waves)

    counts = [s for s in range(1, max_splits + 1) if holding(s) == s]
    best = max(filled(s) for s in counts)
    splits = next(s for s in counts if filled(s) >= 0.95 * best)
    if programs * 8 <= slots:
        splits = max(splits, holding(min(8, max(1, n_keys // 64))))
    return max(1, splits)


_OCCUPANCY: dict = {}
# How a paged cache whose page size is a multiple of the key tile finds a context tile's page (the
# others only for measuring; their times against the dense layout: docs/perf/attention.md, session 10):
# "prefetch": one table load per tile, issued a tile ahead (its latency hides behind the current tile);
# "tile": one per tile, in the tile's step (the load before the K/V copies stalls the 3-stage pipeline);
# "key": one per key, as for other page sizes.
_PAGE_LOOKUP = "prefetch"


def _resident_per_sm(device: torch.device, consts: dict, dtypes: tuple, args) -> int | None:
    """Resident programs per SM of the attention kernel variant `consts` (compiled once, not launched:
    Triton's warmup), cached per device and variant; None where it cannot be told. args(splits, ws…)
    gives the run-time arguments; the probe compiles the split variant (the one whose grid this sizes)."""
    key = (device, dtypes, tuple(sorted(consts.items())))
    if key not in _OCCUPANCY:
        ws = torch.empty(1, device=device, dtype=torch.float32)
        try:
            locks = torch.empty(1, device=device, dtype=torch.int32)
            kernel = _split_kv_kernel.warmup(*args(2, ws, ws, ws, locks), grid=(1,), SPLIT=True, BLOCK_S=2,
                                             **consts)
        except Exception:  # a Triton without warmup: keep the estimate
            kernel = None
        _OCCUPANCY[key] = None if kernel is None else occupancy.compiled_occupancy(kernel, device)
    return _OCCUPANCY[key]


def _merge_rows(n_rows: int, num_sms: int) -> int:
    """Output rows per merge program: a power of two in [2, 16] giving ≥ 2 programs per SM."""
    r = max(2, min(16, n_rows // (2 * num_sms)))
    return 1 << (r.bit_length() - 1)


def decode_attention(q, k_cache, v_cache, lengths, *, pending=0, new_mask=None, ctx_idx=None, ctx_valid=None,
                     q_positions=None, sliding_window=None, live=None, num_splits=None,
                     block_table=None, ctx_span=None) -> torch.Tensor:
    """Attention of T new tokens per row over one layer of the KV cache.

    q: [B, Hq, T, D] (any strides); lengths: [B] int (on the device, never read on the host).
    k_cache, v_cache: one layer of a paged cache [pages, Hkv, page_size, D] with block_table [B, W]
    (int32/int64, on the device, read only in the kernel): logical slot s of row b lives at
    k_cache[block_table[b, s // page_size], :, s % page_size]; the table covers every slot the call
    reads (s < L_b + P + T) — entries past that are never read. block_table None: the dense layout
    [B, Hkv, capacity, D], row b's slot s at k_cache[b, :, s] (the table arange(B)[:, None], page_size =
    capacity). Everything else is in logical slots: lengths, ctx_idx, q_positions and the pending + new
    tokens at L_b + r. pending: P. new_mask: [T, P + T] or [B or 1, T, P + T] bool (or those bits
    packed by `pack_new_mask`), None → causal. ctx_idx / ctx_valid: [B, H', C] (H' = 1 or Hkv) context
    view, None → slots [0, L_b). ctx_span: (span_lengths [B] int on the device, sinks, window) — instead of
    a view, StreamingLLM's slots [0, sinks) and [S_b - window, S_b) (S = span_lengths, the lengths the view
    was taken at: `reference.SpanView`), read as contiguous tiles. q_positions: [B, T] positions for the
    sliding window (the window applies only with both given, as in the reference). live: [B] integer 0/1
    or None: rows with 0 (finished) read none of their context, only the pending + new tokens. num_splits:
    None → `default_num_splits` for this kernel variant's occupancy (`num_splits_for`).
    Returns [B, T, Hq, D] contiguous, q's dtype.
    """
    plan = _Plan(q, k_cache, v_cache, lengths, pending, new_mask, ctx_idx, ctx_valid, q_positions, sliding_window,
                 live, num_splits, block_table, ctx_span)
    B, Hq, T, D = q.shape
    splits, out = plan.num_splits, plan.out
    if splits > 1:
        rows = B * T * Hq * splits
        ws_acc = torch.empty(rows, D, device=q.device, dtype=torch.float32)
        ws_ml = torch.empty(2, rows, device=q.device, dtype=torch.float32)
        ws_m, ws_l = ws_ml[0], ws_ml[1]
    else:
        ws_acc = ws_m = ws_l = out  # unused
    # (the kernel's FUSED_MERGE form, the split programs merging themselves, measured slower and is never
    # launched: FUSED_MERGE=False, LOCKS unread)
    _split_kv_kernel[plan.grid](*plan.args(splits, ws_acc, ws_m, ws_l, lengths), SPLIT=splits > 1,
                                BLOCK_S=triton.next_power_of_2(splits), **plan.consts)
    if splits > 1:
        n_rows = B * T * Hq
        block_r = _merge_rows(n_rows, _num_sms(q.device))
        use_pdl = plan.consts["PDL"]
        _merge_kernel[(triton.cdiv(n_rows, block_r),)](
            ws_acc, ws_m, ws_l, out, n_rows, splits, D=D, BLOCK_R=block_r,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=plan.consts["BLOCK_D"], PDL=use_pdl, num_warps=4,
            **pdl.launch_options(use_pdl))
    return out


def num_splits_for(q, k_cache, v_cache, lengths, *, pending=0, new_mask=None, ctx_idx=None, ctx_valid=None,
                   q_positions=None, sliding_window=None, live=None, block_table=None, ctx_span=None) -> int:
    """The split count `decode_attention` takes for these arguments (benchmarks report it)."""
    return _Plan(q, k_cache, v_cache, lengths, pending, new_mask, ctx_idx, ctx_valid, q_positions, sliding_window,
                 live, None, block_table, ctx_span).num_splits


class _Plan:
    """One decode_attention call's launch: kernel variant (consts), run-time arguments, grid, splits."""

    def __init__(self, q, k_cache, v_cache, lengths, pending, new_mask, ctx_idx, ctx_valid, q_positions,
                 sliding_window, live, num_splits, block_table=None, ctx_span=None):
        B, Hq, T, D = q.shape
        Bk, Hkv, page_size, Dk = k_cache.shape
        assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0, "shape mismatch"
        paged = block_table is not None
        if paged:
            assert block_table.dim() == 2 and block_table.shape[0] == B, \
                f"block_table {tuple(block_table.shape)} != [B = {B}, W]"
            assert block_table.dtype in (torch.int32, torch.int64), f"block_table dtype {block_table.dtype}"
            assert block_table.device == q.device, "block_table must be on q's device"
            cap = block_table.shape[1] * page_size  # logical capacity of a row
        else:
            assert Bk == B, f"dense caches {tuple(k_cache.shape)}: want [B = {B}, Hkv, capacity, D]"
            cap = page_size
        assert q.dtype in _DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "dtype mismatch"
        assert D <= _MAX_HEAD_DIM, f"head dim {D} > {_MAX_HEAD_DIM}"
        G = Hq // Hkv
        has_view = ctx_idx is not None
        has_span = ctx_span is not None
        has_window = sliding_window is not None and q_positions is not None
        C = ctx_idx.shape[2] if has_view else 0
        sinks = recent = 0
        if has_span:
            assert not has_view, "a span view or a gathered view, not both"
            span_lengths, sinks, recent = ctx_span
            sinks, recent = int(sinks), int(recent)
            assert span_lengths.shape == (B,) and span_lengths.device == q.device, \
                f"span lengths {tuple(span_lengths.shape)} on {span_lengths.device}: want [B = {B}] on {q.device}"
            assert sinks >= 0 and recent >= 1, f"span sinks {sinks}, window {recent}"
        cfg = _launch_config(G * T, D, q.dtype, _big_shared_memory(q.device),
                             C if has_view else sinks + recent if has_span else cap, has_view)
        m_tiles = triton.cdiv(G * T, cfg["BLOCK_M"])
        self.out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
        nm, nm_strides = _new_mask_arg(new_mask, lengths, T, pending, cfg["BLOCK_R"])
        if has_span:  # the kernel reads span_lengths[b] (stride_b) where a view's indices would be
            ci, ci_strides = span_lengths, (span_lengths.stride(0), 0, 0)
        else:
            ci, ci_strides = _view_arg(ctx_idx, lengths, B, Hkv)
        cv, cv_strides = _view_arg(None if ctx_valid is None else ctx_valid.view(torch.uint8), lengths, B, Hkv)
        qp, qp_strides = (q_positions, q_positions.stride()) if has_window else (lengths, (0, 0))
        bt, bt_strides = (block_table, block_table.stride()) if paged else (lengths, (0, 0))
        upcast = _INTERPRET and q.dtype == torch.bfloat16
        use_pdl = pdl.enabled(q.device)
        # One table lookup per context tile where no tile crosses a page (tiles start at multiples of
        # BLOCK_N); else, and for gathered views and the recent keys, one lookup per key.
        page_tiles = paged and not has_view and page_size % cfg["BLOCK_N"] == 0 and _PAGE_LOOKUP != "key"
        self.consts = dict(G=G, D=D, HAS_VIEW=has_view, HAS_SPAN=has_span, HAS_NEW_MASK=new_mask is not None,
                           HAS_WINDOW=has_window, HAS_LIVE=live is not None, PAGED=paged, PAGE_TILES=page_tiles,
                           PREFETCH=page_tiles and _PAGE_LOOKUP == "prefetch", UPCAST=upcast,
                           FUSED_MERGE=False, PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
                           PDL=use_pdl, **cfg, **pdl.launch_options(use_pdl))
        self._run_args = (q, k_cache, v_cache, lengths, live if live is not None else lengths, nm, ci, cv, qp, bt,
                          self.out)
        self._scalars = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *nm_strides, *ci_strides,
                         *cv_strides, *qp_strides, *bt_strides, page_size, _LOG2E / math.sqrt(D),
                         sliding_window if has_window else 0, Hkv, T, pending, C, sinks, recent)
        if num_splits is None:
            programs = B * Hkv * m_tiles
            n_keys, min_keys = (C, VIEW_SPLIT_KEYS) if has_view else (cap, SPLIT_KEYS)
            if has_span:  # the span's tile positions: the sinks' tiles, then ≤ window + a tile of recent slots
                n_keys = min(cap, triton.cdiv(sinks, cfg["BLOCK_N"]) * cfg["BLOCK_N"] + recent + cfg["BLOCK_N"])
            per_sm = None
            if q.is_cuda and not _INTERPRET and n_keys >= 2 * min_keys:  # (shorter ones: one split at most)
                per_sm = _resident_per_sm(q.device, self.consts,
                                          (q.dtype, lengths.dtype, nm.dtype, ci.dtype, qp.dtype, bt.dtype), self.args)
            num_splits = default_num_splits(n_keys, programs, _num_sms(q.device), cfg["BLOCK_M"], per_sm, min_keys,
                                            cfg["BLOCK_N"])
        self.num_splits = max(1, int(num_splits))
        self.grid = (m_tiles, self.num_splits, B * Hkv)

    def args(self, splits, ws_acc, ws_m, ws_l, locks) -> tuple:
        """The kernel's run-time arguments for `splits` splits, these workspaces and arrival counters."""
        return (*self._run_args, ws_acc, ws_m, ws_l, locks, *self._scalars, splits)


def pack_new_mask(new_mask: torch.Tensor) -> torch.Tensor:
    """A bool mask [..., T, W] as bits: int64 words [..., T, cdiv(W, 64)], bit j of word w = mask[..., t,
    64 w + j]. The kernel reads one word per query row and key tile instead of a [rows, keys] tile of
    bytes (whose pointer tile cost registers, and with them occupancy). Build it once per forward
    (AttentionMetadata.packed_new_mask): every layer shares it."""
    W = new_mask.shape[-1]
    words = -(-W // 64)
    m = F.pad(new_mask.to(torch.int64), (0, 64 * words - W)).unflatten(-1, (words, 64))
    bits = torch.ones(64, dtype=torch.int64, device=m.device) << torch.arange(64, device=m.device)
    return (m * bits).sum(-1)  # distinct bits never carry (bit 63 is the sign bit: same pattern)


def _new_mask_arg(new_mask, placeholder, T, P, block_r):
    """new_mask [T, P+T], [1, T, P+T] or [B, T, P+T] bool, or its packed words (pack_new_mask: int64
    [.., T, cdiv(P+T, 64)]) → (int64 words, (stride_b, stride_t, stride_w))."""
    if new_mask is None:
        return placeholder, (0, 0, 0)
    assert 64 % block_r == 0, "a recent-key tile must lie in one mask word"
    if new_mask.dtype == torch.int64:
        assert new_mask.shape[-2:] == (T, triton.cdiv(P + T, 64)), \
            f"packed new_mask {tuple(new_mask.shape)} != [.., {T}, {triton.cdiv(P + T, 64)}]"
        m = new_mask
    else:
        assert new_mask.shape[-2:] == (T, P + T), f"new_mask {tuple(new_mask.shape)} != [.., {T}, {P + T}]"
        m = pack_new_mask(new_mask.bool())
    if m.dim() == 2:
        return m, (0, *m.stride())
    return m, (0 if m.shape[0] == 1 else m.stride(0), *m.stride()[1:])


def _view_arg(x, placeholder, B, Hkv):
    """ctx_idx / ctx_valid [B, H', C] → (tensor, strides) with stride_h = 0 when H' = 1 (shared)."""
    if x is None:
        return placeholder, (0, 0, 0)
    assert x.dim() == 3 and x.shape[0] == B and x.shape[1] in (1, Hkv), f"view shape {tuple(x.shape)}"
    sb, sh, sc = x.stride()
    return x, (sb, 0 if x.shape[1] == 1 else sh, sc)
