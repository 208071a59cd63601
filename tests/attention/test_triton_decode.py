"""The Triton decode/verify/tree attention kernel against a float64 reference over explicit key lists.

Cases: GQA shapes, ragged lengths (0, not a multiple of the key block), causal chains, random token
trees with pending tokens, context views (shared or per KV head, with invalid entries), sliding
windows, several split counts, rows with no visible key; bf16 within 1e-2 relative error, fp32 (IEEE
dots) within 1e-5; never NaN. Cache slots the kernel must not read hold NaN.
Paged caches (block_table): the same caches cut into pages (1, 3, 16, 64, 128, 256 slots; ones that do
and do not divide the 64-key tile), placed at a random permutation of physical pages among NaN pages no
row owns (the table's unused entries name one too): the same result as the dense layout (bit for bit
in the interpreter) and the float64 reference, for chains, trees, views, windows, finished rows and
int32/int64 tables.

Where they run:
  * on CUDA, in this process, when a GPU is there;
  * on the CPU through Triton's interpreter, in a child pytest run of this file with
    TRITON_INTERPRET=1 (`test_interpreter_suite`): the variable must be set before triton is first
    imported, which this process has already done.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from redwood.attention import reference  # noqa: E402
from redwood.attention import triton_decode as td  # noqa: E402
from tests.conftest import import_without_triton, interpreter_broken, run_in_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
SMALL = DEVICE == "cpu"  # the interpreter runs every program in Python: keep contexts short there
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}

needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="no CUDA device (the interpreter runs these in test_interpreter_suite)"
)


if INTERPRET and (why := interpreter_broken()):
    pytest.skip(why, allow_module_level=True)


# ----------------------------------------------------------------------------------------------------
# Inputs and the float64 reference


def random_tree_mask(gen: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of T nodes in topological order → ancestor-or-self mask [T, T] bool, depths [T]."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    anc = torch.eye(T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.int64)
    for i in range(1, T):
        anc[i] |= anc[parent[i]]
        depth[i] = depth[parent[i]] + 1
    return anc, depth


def make_view(gen: torch.Generator, lengths: list[int], heads: int, C: int, cap: int):
    """ctx_idx [B, heads, C] / ctx_valid: a random subset of each row's slots [0, L) in random order,
    the rest invalid with junk indices (-1, past the capacity, a duplicate, a never-written slot)."""
    B = len(lengths)
    idx = torch.empty(B, heads, C, dtype=torch.int64)
    valid = torch.zeros(B, heads, C, dtype=torch.bool)
    for b, L in enumerate(lengths):
        for h in range(heads):
            n = min(L, C - 2) if L else 0
            idx[b, h, :n] = torch.randperm(L, generator=gen)[:n]
            valid[b, h, :n] = torch.rand(n, generator=gen) < 0.8
            junk = torch.tensor([-1, cap + 7, cap - 1, int(idx[b, h, 0]) if n else 0])
            idx[b, h, n:] = junk[torch.randint(0, 4, (C - n,), generator=gen)]
        perm = torch.randperm(C, generator=gen)
        idx[b], valid[b] = idx[b][:, perm], valid[b][:, perm]
    return idx, valid


def make_inputs(gen, *, B, Hq, Hkv, T, D, lengths, P=0, dtype=torch.bfloat16, cap=None):
    """q [B, Hq, T, D] as a transposed view; k/v caches [B, Hkv, cap, D] with non-trivial strides.

    Slots ≥ L_b + P + T are never written in a real step: they hold NaN here, so reading them shows.
    """
    cap = cap or max(lengths) + P + T + 9
    q = (torch.randn(B, T, Hq, D, generator=gen) * 1.5).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, cap, D + 8, generator=gen).to(dtype)[..., :D]  # padded rows
    v = torch.randn(2, B, Hkv, cap, D, generator=gen).to(dtype)[1]  # one layer of a cache
    for b, L in enumerate(lengths):
        k[b, :, L + P + T :] = float("nan")
        v[b, :, L + P + T :] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int64)


def reference_attention(
    q,
    k,
    v,
    lengths,
    *,
    pending=0,
    new_mask=None,
    ctx_idx=None,
    ctx_valid=None,
    q_positions=None,
    sliding_window=None,
    live=None,
) -> torch.Tensor:
    """float64 attention over explicit key lists per (row, KV head) → [B, T, Hq, D]. live[b] = 0: row b
    sees none of its context (only pending + new tokens)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G, W = Hq // Hkv, pending + T
    if new_mask is None:
        new_mask = torch.arange(W)[None, :] <= pending + torch.arange(T)[:, None]
    new_mask = new_mask.cpu().expand(B, T, W)
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        for h in range(Hkv):
            if ctx_idx is None:
                ctx, ok = torch.arange(L), torch.ones(L, dtype=torch.bool)
            else:
                hh = h if ctx_idx.shape[1] > 1 else 0
                ctx, ok = ctx_idx[b, hh].cpu(), ctx_valid[b, hh].cpu()
            if live is not None and not live[b]:
                ok = torch.zeros_like(ok)
            slots = torch.cat([ctx, L + torch.arange(W)])  # [S]
            visible = torch.cat([ok[None, :].expand(T, -1), new_mask[b]], dim=1)  # [T, S]
            if sliding_window is not None and q_positions is not None:
                visible &= q_positions[b].cpu()[:, None] - slots[None, :] < sliding_window
            used = visible.any(0)
            safe = torch.where(used, slots, 0)
            kk = torch.where(used[:, None], k[b, h, safe], 0.0)  # unused keys may be NaN slots
            vv = torch.where(used[:, None], v[b, h, safe], 0.0)
            s = q[b, h * G : (h + 1) * G] @ kk.T / math.sqrt(D)  # [G, T, S]
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
            out[b, :, h * G : (h + 1) * G] = (p @ vv).transpose(0, 1)
    return out


def paginate(gen, k, v, lengths, reach, page_size, spare=3, dtype=torch.int32):
    """The dense caches k, v [B, Hkv, cap, D] as a paged cache: row b's slots [0, L_b + reach) — what a
    call reads — cut into pages of page_size slots, placed at a random permutation of the physical pages
    among `spare` pages of NaN that no row owns. The table's entries past a row's pages name a NaN page
    (a kernel must not read them), as do the slots past L_b + reach within a row's last page (from the
    dense caches' NaN). → k_pages [num_pages, Hkv, page_size, D] (rows padded: non-trivial strides),
    v_pages (one layer of two), block_table [B, cdiv(cap, page_size)]."""
    B, Hkv, cap, D = k.shape
    width = -(-cap // page_size)
    need = [-(-(int(L) + reach) // page_size) for L in lengths]
    n_pages = sum(need) + spare
    perm = torch.randperm(n_pages, generator=gen)
    kp = torch.full((n_pages, Hkv, page_size, D + 8), float("nan"), dtype=k.dtype)[..., :D]
    vp = torch.full((2, n_pages, Hkv, page_size, D), float("nan"), dtype=v.dtype)[1]
    table = torch.full((B, width), int(perm[-1]), dtype=dtype)  # a spare page (NaN)
    i = 0
    for b in range(B):
        for j in range(need[b]):
            page, s0 = int(perm[i]), j * page_size
            i += 1
            n = min(page_size, cap - s0)
            table[b, j] = page
            kp[page, :, :n] = k[b, :, s0 : s0 + n]
            vp[page, :, :n] = v[b, :, s0 : s0 + n]
    return kp, vp, table


def to_device(*xs):
    return [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in xs]


def run_and_check(q, k, v, lengths, pack_mask=False, paged=None, **kw) -> torch.Tensor:
    """The kernel on DEVICE vs the float64 reference: no NaN, relative error within TOL. pack_mask: the
    kernel gets new_mask as packed words (pack_new_mask: what the model passes), the reference as bools.
    paged: (k_pages, v_pages, block_table) holding k, v (paginate): the kernel reads those instead."""
    num_splits = kw.pop("num_splits", None)
    ref = reference_attention(q, k, v, lengths, **kw)
    dev_kw = {name: to_device(x)[0] for name, x in kw.items()}
    if pack_mask:
        dev_kw["new_mask"] = td.pack_new_mask(dev_kw["new_mask"])
    if paged is not None:
        k, v, dev_kw["block_table"] = to_device(*paged)
    out = td.decode_attention(*to_device(q, k, v, lengths), num_splits=num_splits, **dev_kw)
    B, Hq, T, D = q.shape
    assert out.shape == (B, T, Hq, D) and out.dtype == q.dtype and out.is_contiguous()
    out = out.double().cpu()
    assert not out.isnan().any()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= TOL[q.dtype], f"relative error {err:.2e} > {TOL[q.dtype]:.0e}"
    return out


def lengths_for(B: int, seed: int) -> list[int]:
    """Ragged lengths: 0, odd sizes not a multiple of the 64-key block; longer on a GPU."""
    scale = 1 if SMALL else 9
    pool = [0, 37 * scale, 130 * scale] if B > 1 else [77 * scale]
    return [pool[(i + seed) % len(pool)] for i in range(B)]


# ----------------------------------------------------------------------------------------------------
# Kernel cases (DEVICE: CUDA in this process, or the CPU in the interpreter child run)

HEADS = [(12, 2), (14, 2), (4, 4), (8, 1)]
CAUSAL = [
    (hq, hkv, (64, 128)[i % 2], t, (3, 1)[(i // 2) % 2])
    for i, ((hq, hkv), t) in enumerate((h, t) for h in HEADS for t in (1, 2, 5, 8, 16))
]


@needs_kernel
@pytest.mark.parametrize("Hq,Hkv,D,T,B", CAUSAL)
def test_causal_chain_bf16(Hq, Hkv, D, T, B):
    gen = torch.Generator().manual_seed(hash((Hq, Hkv, D, T, B)) % 2**31)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lengths_for(B, T))
    run_and_check(q, k, v, lengths, num_splits=(1, 3)[T % 2])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D,T,P", [(12, 2, 64, 5, 0), (8, 1, 128, 1, 3), (4, 4, 96, 3, 2)])
def test_causal_other_dtypes(dtype, Hq, Hkv, D, T, P):
    """fp32 goes through IEEE dots (1e-5); D = 96 is padded to a 128 block."""
    gen = torch.Generator().manual_seed(T * 7 + P)
    q, k, v, lengths = make_inputs(gen, B=3, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lengths_for(3, P), P=P, dtype=dtype)
    run_and_check(q, k, v, lengths, pending=P, num_splits=2)


@needs_kernel
@pytest.mark.parametrize("T", [7, 64])
@pytest.mark.parametrize("P", [0, 3])
@pytest.mark.parametrize("per_row", [False, True])
def test_tree(T, P, per_row):
    """Ancestor masks of random trees (one shared, or one per row), after P pending tokens; per-row
    masks go in packed (pack_new_mask: what the model passes, one pack per forward)."""
    gen = torch.Generator().manual_seed(T * 10 + P + per_row)
    Hq, Hkv, B = (12, 2, 3) if T < 32 else (4, 2, 2)
    trees = [random_tree_mask(gen, T)[0] for _ in range(B if per_row else 1)]
    masks = [torch.cat([torch.ones(T, P, dtype=torch.bool), anc], dim=1) for anc in trees]
    new_mask = torch.stack(masks) if per_row else masks[0][None] if P else masks[0]  # [B|1, T, W] / [T, W]
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=64, lengths=lengths_for(B, T), P=P)
    run_and_check(q, k, v, lengths, pending=P, new_mask=new_mask, num_splits=2, pack_mask=per_row)


@pytest.mark.parametrize("shape", [(5, 1), (3, 64), (2, 4, 130)])
def test_pack_new_mask_keeps_every_bit(shape):
    """Bit j of word w of row t is mask[t, 64 w + j], the sign bit (j = 63) included; a partial last
    word is zero-padded. (Plain torch: runs without the kernel.)"""
    gen = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=gen) < 0.5
    mask[..., 63:64] = True  # the sign bit set where present
    words = td.pack_new_mask(mask)
    W = shape[-1]
    assert words.dtype == torch.int64 and words.shape == (*shape[:-1], -(-W // 64))
    bits = (words[..., :, None] >> torch.arange(64)) & 1  # [..., words, 64]
    unpacked = bits.flatten(-2).bool()
    assert torch.equal(unpacked[..., :W], mask) and not unpacked[..., W:].any()


@needs_kernel
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("T,P,tree", [(1, 0, False), (4, 3, False), (9, 2, True)])
def test_context_view(shared, T, P, tree):
    """Context through ctx_idx/ctx_valid: shared by the KV heads (H' = 1) or per KV head."""
    gen = torch.Generator().manual_seed(T + 100 * P + shared)
    B, Hq, Hkv, D = 3, 12, 2, 128
    lens = lengths_for(B, T)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    C = 50 if SMALL else 300
    ctx_idx, ctx_valid = make_view(gen, lens, 1 if shared else Hkv, C, k.shape[2])
    new_mask = None
    if tree:
        new_mask = torch.cat([torch.ones(T, P, dtype=torch.bool), random_tree_mask(gen, T)[0]], dim=1)
    run_and_check(q, k, v, lengths, pending=P, new_mask=new_mask, ctx_idx=ctx_idx, ctx_valid=ctx_valid, num_splits=3)


@needs_kernel
@pytest.mark.parametrize("window", [3, 40, 100])
@pytest.mark.parametrize("mode", ["chain", "tree", "view"])
def test_sliding_window(window, mode):
    """Keys with q_position - slot ≥ window are dropped (and whole blocks before it skipped)."""
    gen = torch.Generator().manual_seed(window + len(mode))
    B, Hq, Hkv, T, P, D = 3, 8, 2, 6, 2, 64
    lens = lengths_for(B, window)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    kw = dict(pending=P, sliding_window=window)
    depth = torch.arange(T)
    if mode == "tree":
        anc, depth = random_tree_mask(gen, T)
        kw["new_mask"] = torch.cat([torch.ones(T, P, dtype=torch.bool), anc], dim=1)
    if mode == "view":
        kw["ctx_idx"], kw["ctx_valid"] = make_view(gen, lens, Hkv, 40, k.shape[2])
    kw["q_positions"] = lengths[:, None] + P + depth[None, :]
    run_and_check(q, k, v, lengths, num_splits=2, **kw)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_counts_agree(dtype):
    """1 split, a few, more splits than key blocks, and the default: the same result."""
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, T, D = 3, 12, 2, 3, 64
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lengths_for(B, 0), dtype=dtype)
    splits = (1, 2, 5, None) if SMALL else (1, 2, 5, 64, None)  # 5 already leaves splits empty
    outs = [run_and_check(q, k, v, lengths, num_splits=s) for s in splits]
    for o in outs[1:]:
        assert ((o - outs[0]).norm() / outs[0].norm()).item() <= TOL[dtype]


@needs_kernel
@pytest.mark.parametrize("view", [False, True])
def test_finished_rows_read_none_of_their_context(view):
    """live[b] = 0: row b attends only to its pending + new tokens; its context slots hold NaN here, so a
    read shows. Rows still live are unaffected."""
    gen = torch.Generator().manual_seed(21 + view)
    B, Hq, Hkv, T, P, D = 3, 12, 2, 4, 2, 64
    lens = [40, 130, 77] if SMALL else [400, 1300, 770]
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    k[1, :, : lens[1]] = float("nan")
    v[1, :, : lens[1]] = float("nan")
    live = torch.tensor([1, 0, 1])
    kw = {}
    if view:
        kw = dict(zip(("ctx_idx", "ctx_valid"), make_view(gen, lens, 1, 30, k.shape[2])))
    out = run_and_check(q, k, v, lengths, pending=P, live=live, num_splits=3, **kw)
    assert not out[1].isnan().any()


@needs_kernel
def test_rows_without_visible_keys_are_zero():
    """Empty context (L = 0 or an all-invalid view) and a new-mask row with no True: output 0."""
    gen = torch.Generator().manual_seed(9)
    B, Hq, Hkv, T, D = 2, 4, 2, 3, 64
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=[0, 50])
    new_mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None].repeat(B, 1, 1)
    new_mask[:, 1] = False  # token 1 sees nothing new
    for kw in (
        dict(),
        dict(ctx_idx=torch.zeros(B, 1, 4, dtype=torch.int64), ctx_valid=torch.zeros(B, 1, 4, dtype=torch.bool)),
    ):
        for splits in (1, 4):
            out = run_and_check(q, k, v, lengths, new_mask=new_mask, num_splits=splits, **kw)
            assert (out[:, 1] == 0).all() if kw else (out[0, 1] == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    """No host sync, allocations from shapes only: capture once, change lengths in place, replay (with
    the merge kernel)."""
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, T, D = 3, 12, 2, 4, 128
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=[1300] * B, cap=1400)
    q, k, v, lengths = to_device(q, k, v, lengths)  # slots < 1304 are written (valid for both sets below)
    lengths.copy_(torch.tensor([500, 900, 1300]))
    for splits in (None, 4):  # the default (1 split here) and the split + merge path
        td.decode_attention(q, k, v, lengths, num_splits=splits)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = td.decode_attention(q, k, v, lengths, num_splits=splits)
        for new in ([500, 900, 1300], [7, 1200, 64]):
            lengths.copy_(torch.tensor(new))
            graph.replay()
            torch.cuda.synchronize()
            ref = reference_attention(q, k, v, lengths)
            assert not out.isnan().any()
            assert ((out.double().cpu() - ref).norm() / ref.norm()).item() <= 1e-2


# ----------------------------------------------------------------------------------------------------
# Paged caches: K/V [pages, Hkv, page_size, D] read through a block table

PAGE_SIZES = [1, 3, 16, 64, 128, 256]  # 1 and 3: per-key lookups; 64k: one lookup per 64-key tile


def assert_same(out: torch.Tensor, dense: torch.Tensor) -> None:
    """Paged vs dense result: the same bits in the interpreter (the same values in the same order); on
    CUDA (another compiled variant) within a fraction of the bf16 tolerance."""
    if INTERPRET:
        assert torch.equal(out, dense)
    else:
        assert ((out - dense).norm() / dense.norm().clamp_min(1e-30)).item() <= 2.5e-3


@needs_kernel
@pytest.mark.parametrize("page_size", PAGE_SIZES + ["dense"])
@pytest.mark.parametrize("T,P,tree", [(1, 0, False), (5, 2, False), (7, 3, True)])
def test_paged_cache_equals_dense(page_size, T, P, tree):
    """Through a random block table (rows of different lengths, pages shuffled among NaN pages no row
    owns): the dense layout's result and the float64 reference's — for decode, chains after pending
    tokens and trees. "dense": the dense caches themselves with the identity table (page_size =
    capacity, an arbitrary integer) through the paged variant."""
    gen = torch.Generator().manual_seed(hash((page_size, T, P)) % 2**31)
    B, Hq, Hkv, D = 3, 12, 2, 64
    lens = lengths_for(B, T)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    kw = dict(pending=P)
    if tree:
        kw["new_mask"] = torch.cat([torch.ones(T, P, dtype=torch.bool), random_tree_mask(gen, T)[0]], dim=1)
    if page_size == "dense":
        paged = (k, v, torch.arange(B, dtype=torch.int32)[:, None])
    else:
        paged = paginate(gen, k, v, lens, P + T, page_size)
    for splits in (1, 3):  # one split walks many tiles (and pages) in a row
        dense = run_and_check(q, k, v, lengths, num_splits=splits, **kw)
        assert_same(run_and_check(q, k, v, lengths, paged=paged, num_splits=splits, **kw), dense)


@needs_kernel
@pytest.mark.parametrize("mode", ["prefetch", "tile", "key"])
def test_page_lookup_modes_agree(mode, monkeypatch):
    """The three ways to find a context tile's page (td._PAGE_LOOKUP: a tile ahead — the default —, in
    the tile's step, per key) read the same keys: the dense result, with a window's skipped tiles too."""
    monkeypatch.setattr(td, "_PAGE_LOOKUP", mode)
    gen = torch.Generator().manual_seed(77)
    B, Hq, Hkv, T, P, D = 3, 12, 2, 5, 1, 64
    lens = lengths_for(B, 1)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    paged = paginate(gen, k, v, lens, P + T, 64)
    for kw in (
        dict(num_splits=2),
        dict(num_splits=3, sliding_window=70, q_positions=lengths[:, None] + P + torch.arange(T)[None, :]),
    ):
        dense = run_and_check(q, k, v, lengths, pending=P, **kw)
        assert_same(run_and_check(q, k, v, lengths, paged=paged, pending=P, **kw), dense)


@needs_kernel
@pytest.mark.parametrize(
    "dtype,table_dtype,page_size",
    [
        (torch.float32, torch.int64, 32),
        (torch.float32, torch.int32, 48),
        (torch.float16, torch.int64, 64),
        (torch.bfloat16, torch.int32, 96),
    ],
)
def test_paged_other_dtypes_tables_and_default_splits(dtype, table_dtype, page_size):
    """fp32 (32-key tiles: 32 takes one lookup per tile, 48 one per key), fp16, int32 and int64 tables,
    a page size (96) that is no multiple of the 64-key tile; the default split count and a few."""
    gen = torch.Generator().manual_seed(page_size)
    B, Hq, Hkv, T, P, D = 3, 8, 2, 3, 1, 64
    lens = lengths_for(B, 2)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P, dtype=dtype)
    paged = paginate(gen, k, v, lens, P + T, page_size, dtype=table_dtype)
    for splits in (None, 1, 4):
        dense = run_and_check(q, k, v, lengths, pending=P, num_splits=splits)
        assert_same(run_and_check(q, k, v, lengths, paged=paged, pending=P, num_splits=splits), dense)


SPANS = [  # sinks, window, T, P, page_size, splits, live, taken_earlier
    (4, 20, 1, 0, None, None, False, False),
    (4, 100, 1, 0, 64, None, False, False),
    (4, 100, 3, 2, 64, 3, True, False),
    (0, 37, 1, 0, 64, 2, False, False),
    (70, 20, 2, 0, 128, None, False, False),
    (4, 20, 4, 1, 3, 3, False, True),
    (2, 5, 1, 0, 1, 1, True, False),
    (4, 60, 1, 0, 16, 4, False, True),
]


@needs_kernel
@pytest.mark.parametrize("sinks,window,T,P,page_size,splits,live,taken_earlier", SPANS)
def test_span_view(sinks, window, T, P, page_size, splits, live, taken_earlier):
    """StreamingLLM's view read as two slot ranges (ctx_span) == the same view gathered through its indices,
    for rows shorter than the sinks, inside the window and far past it; tile-aligned pages (one lookup a
    tile, ranges straddling tiles), other page sizes and the dense layout; the view taken at earlier
    lengths than the call's (its ranges end there)."""
    gen = torch.Generator().manual_seed(sinks + 7 * window + 31 * T + (page_size or 0))
    B, Hq, Hkv, D = 5, 12, 2, 64
    lens = [0, 3, sinks + window - 1, 130 if SMALL else 1170, 300 if SMALL else 3000]
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    taken = (lengths - 2).clamp(min=0) if taken_earlier else lengths
    span = reference.SpanView(taken, sinks, window)
    idx, valid = span(0)
    kw = dict(pending=P, ctx_idx=idx, ctx_valid=valid, num_splits=splits)
    if live:
        kw["live"] = torch.tensor([1, 1, 0, 1, 1])
    gathered = run_and_check(q, k, v, lengths, **kw)
    ref = reference_attention(q, k, v, lengths, **{n: x for n, x in kw.items() if n != "num_splits"})
    paged = None if page_size is None else paginate(gen, k, v, lens, P + T, page_size)
    dev = dict(pending=P, num_splits=splits, ctx_span=(to_device(taken)[0], sinks, window))
    if live:
        dev["live"] = to_device(kw["live"])[0]
    if paged is not None:
        k, v, dev["block_table"] = to_device(*paged)
    out = td.decode_attention(*to_device(q, k, v, lengths), **dev).double().cpu()
    assert not out.isnan().any()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err <= TOL[q.dtype], f"relative error {err:.2e}"
    assert ((out - gathered).norm() / ref.norm()).item() <= TOL[q.dtype]


def test_span_view_indices_match_the_streaming_policy():
    """SpanView's indices are StreamingLLM's (sinks, then the last `window` committed slots; a recent slot
    below the sinks or below 0 is invalid), built once per forward and shared by every layer."""
    from redwood.kv.policies import StreamingPolicy

    lengths = torch.tensor([0, 2, 6, 9, 40])
    view = StreamingPolicy(4, 5).view(lengths)
    assert isinstance(view, reference.SpanView) and (view.sinks, view.window) == (4, 5)
    idx, valid = view(0)
    assert idx.shape == valid.shape == (5, 1, 9) and view(7)[0] is idx
    for b, L in enumerate(lengths.tolist()):
        slots = {int(i) for i, ok in zip(idx[b, 0], valid[b, 0]) if ok}
        assert slots == set(range(min(4, L))) | set(range(max(4, L - 5), L)), (L, slots)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 3, 64])
@pytest.mark.parametrize("shared", [True, False])
def test_paged_context_view(page_size, shared):
    """ctx_idx holds logical slots (with invalid junk: -1, past the capacity, never-written slots): each
    valid one is looked up through the table, as are the pending + new keys."""
    gen = torch.Generator().manual_seed(page_size + 1000 * shared)
    B, Hq, Hkv, T, P, D = 3, 12, 2, 4, 2, 64
    lens = lengths_for(B, page_size)
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    ctx_idx, ctx_valid = make_view(gen, lens, 1 if shared else Hkv, 50 if SMALL else 300, k.shape[2])
    new_mask = torch.cat([torch.ones(T, P, dtype=torch.bool), random_tree_mask(gen, T)[0]], dim=1)
    kw = dict(pending=P, new_mask=new_mask, ctx_idx=ctx_idx, ctx_valid=ctx_valid, num_splits=3)
    dense = run_and_check(q, k, v, lengths, **kw)
    assert_same(run_and_check(q, k, v, lengths, paged=paginate(gen, k, v, lens, P + T, page_size), **kw), dense)


@needs_kernel
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("window", [3, 100])
def test_paged_sliding_window_and_finished_rows(page_size, window):
    """The window's skipped leading tiles and a finished row (live 0, its context NaN) through the table."""
    gen = torch.Generator().manual_seed(page_size * window)
    B, Hq, Hkv, T, P, D = 3, 8, 2, 6, 2, 64
    lens = [40, 130, 77] if SMALL else [400, 1300, 770]
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P)
    k[1, :, : lens[1]] = float("nan")
    v[1, :, : lens[1]] = float("nan")
    kw = dict(
        pending=P,
        sliding_window=window,
        q_positions=lengths[:, None] + P + torch.arange(T)[None, :],
        live=torch.tensor([1, 0, 1]),
        num_splits=2,
    )
    dense = run_and_check(q, k, v, lengths, **kw)
    out = run_and_check(q, k, v, lengths, paged=paginate(gen, k, v, lens, P + T, page_size), **kw)
    assert_same(out, dense)
    assert not out[1].isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_paged_cuda_graph_capture_and_replay():
    """The table is read on the device: capture once, then move every page elsewhere (new table, the
    pages' contents moved with it) and change the lengths in place; each replay reads the new layout."""
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hkv, T, D, cap, ps = 3, 12, 2, 4, 128, 1408, 128
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=[1300] * B, cap=cap)
    # every row owns all of its pages (lengths 0 + reach cap): the same page count for every layout
    kp, vp, table = to_device(*paginate(gen, k, v, [0] * B, cap, ps))
    q, lengths = to_device(q, lengths)
    lengths.copy_(torch.tensor([500, 900, 1300]))
    for splits in (None, 4):
        td.decode_attention(q, kp, vp, lengths, num_splits=splits, block_table=table)  # compile first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = td.decode_attention(q, kp, vp, lengths, num_splits=splits, block_table=table)
        for new in ([500, 900, 1300], [7, 1200, 64]):
            for dst, src in zip((kp, vp, table), paginate(gen, k, v, [0] * B, cap, ps)):
                dst.copy_(src)
            lengths.copy_(torch.tensor(new))
            graph.replay()
            torch.cuda.synchronize()
            ref = reference_attention(q, k, v, lengths)
            assert not out.isnan().any()
            assert ((out.double().cpu() - ref).norm() / ref.norm()).item() <= 1e-2


# ----------------------------------------------------------------------------------------------------
# Host-side checks (no kernel launch) and the interpreter child run


class _DenseLayer:
    """What reference.read_kv reads of a KVCache, for one dense layer k, v [B, Hkv, cap, D]."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def context(self, layer, num_slots):
        return self.k[:, :, :num_slots], self.v[:, :, :num_slots]

    def gather(self, layer, idx):  # logical slots idx [B, H', C] → [B, Hkv, C, D]
        B, Hkv, _, D = self.k.shape
        gidx = idx[..., None].expand(B, Hkv, idx.shape[2], D)
        return torch.gather(self.k, 2, gidx), torch.gather(self.v, 2, gidx)


def test_float64_reference_matches_project_reference():
    """The explicit-key-list reference here equals reference.read_kv + reference.attention."""
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, T, P, D = 3, 6, 2, 5, 2, 16
    lens = [0, 37, 20]
    q, k, v, lengths = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, T=T, D=D, lengths=lens, P=P, dtype=torch.float64)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the project reference reads every slot
    anc, depth = random_tree_mask(gen, T)
    new_mask = torch.cat([torch.ones(T, P, dtype=torch.bool), anc], dim=1)
    ctx_idx, ctx_valid = make_view(gen, lens, Hkv, 12, k.shape[2])
    ctx_idx = torch.where(ctx_valid, ctx_idx, 0)  # the project reference gathers every entry
    q_positions = lengths[:, None] + P + depth[None, :]
    for view, live in itertools.product((None, lambda layer: (ctx_idx, ctx_valid)), (None, torch.tensor([1, 0, 1]))):
        meta = reference.AttentionMetadata(
            lengths=lengths,
            num_new=T,
            kv_len=max(lens) + P + T,
            pending=P,
            new_mask=new_mask,
            q_positions=q_positions,
            sliding_window=30,
            view=view,
            live=live,
        )
        kk, vv, mask = reference.read_kv(_DenseLayer(k, v), 0, meta)
        expected = reference.attention(q, kk, vv, mask).transpose(1, 2)
        view_kw = dict(ctx_idx=ctx_idx, ctx_valid=ctx_valid) if view else {}
        got = reference_attention(
            q,
            k,
            v,
            lengths,
            pending=P,
            new_mask=new_mask,
            q_positions=q_positions,
            sliding_window=30,
            live=live,
            **view_kw,
        )
        torch.testing.assert_close(got, expected)  # every query sees itself: no empty rows


def test_default_num_splits_from_static_shapes():
    """The picks that measured best on an H200 (132 SMs; benchmarks/attention_bench.py --sweep)."""
    cap = 32768 + 8
    assert td.default_num_splits(cap, 64 * 2, 132, block_m=16) == 3  # decode, batch 64: 384 small programs
    assert td.default_num_splits(cap, 64 * 2, 132, block_m=64) == 2  # T = 8: 256 programs, one wave
    assert td.default_num_splits(cap, 8 * 2 * 2, 132) == 8  # 16-node trees at batch 8
    assert td.default_num_splits(cap, 1 * 2 * 12, 132) == 11  # one 128-node tree: 264 programs
    assert td.default_num_splits(1400, 64 * 2, 132, block_m=16) == 1  # short caches, full grid: one split
    # short caches, few programs (batch 1-4: latency-bound): up to 8 splits of ≥ 64 keys
    assert td.default_num_splits(1400, 6, 132) == 8
    assert td.default_num_splits(256, 2, 132, block_m=16) == 4
    assert td.default_num_splits(40, 2, 132, block_m=16) == 1
    assert 48 <= td.default_num_splits(10**7, 1, 132) <= 64  # capped at 64
    # with the compiled variant's occupancy: 32-row tiles at 2 per SM (264 slots) take 2 splits, not 3
    assert td.default_num_splits(cap, 64 * 2, 132, block_m=32) == 3
    assert td.default_num_splits(cap, 64 * 2, 132, block_m=32, per_sm=2) == 2
    assert td.default_num_splits(cap, 64 * 2, 132, block_m=16, per_sm=4) == 4  # 512 of 528 slots
    # a gathered 512-key view at batch 64 (the self-draft's level): splits of ≥ VIEW_SPLIT_KEYS fill a wave
    assert td.default_num_splits(512, 64 * 2, 132, block_m=16) == 1
    assert td.default_num_splits(512, 64 * 2, 132, block_m=16, min_split_keys=td.VIEW_SPLIT_KEYS) == 3
    # with the compiled view variant's ≥ 4 programs an SM (an H100, session 32): the most splits, 4
    assert td.default_num_splits(512, 64 * 2, 132, block_m=16, per_sm=4, min_split_keys=td.VIEW_SPLIT_KEYS) == 4
    # the view's 128-key tiles (_launch_config(view=True)): 3 splits of 512 keys would round to 256 + 256 + 0,
    # so 3 is never picked — 2 fill the wave as well as 4 with the estimate, 4 with 4 programs an SM
    view = dict(block_m=16, min_split_keys=td.VIEW_SPLIT_KEYS, block_n=128)
    assert td.default_num_splits(512, 64 * 2, 132, **view) == 2
    assert td.default_num_splits(512, 64 * 2, 132, per_sm=4, **view) == 4
    assert td.default_num_splits(512, 16 * 2, 132, **view) == 4  # latency-bound: as many as hold keys
    # whatever the shape, every split picked holds keys (the kernel's chunking: whole tiles of block_n)
    for n_keys, programs, block_n, per_sm in itertools.product(
        (40, 300, 512, 1400, 4096, 32776), (2, 8, 128, 1024), (64, 128), (None, 2, 3, 4, 6)
    ):
        for min_keys in (td.VIEW_SPLIT_KEYS, td.SPLIT_KEYS):
            s = td.default_num_splits(n_keys, programs, 132, 16, per_sm, min_keys, block_n)
            chunk = math.ceil(math.ceil(n_keys / s) / block_n) * block_n
            assert 1 <= s <= 64 and (s - 1) * chunk < n_keys, (n_keys, programs, block_n, per_sm, min_keys, s)


def test_launch_config_tiles_and_stages():
    """Packed rows ≤ 16 take 16-row tiles, more take 64 (measured at the KV floor for 4-8 causal tokens
    and 4-8-node trees at batch 64 × 32K, where 32-row tiles reached 85-94%); 3 stages for 64-row tiles
    and for short contexts on large-shared-memory GPUs, never for float32; recent-key steps ≤ 64 keys
    (one tree-mask word)."""
    bf16 = torch.bfloat16
    assert [td._launch_config(m, 128, bf16)["BLOCK_M"] for m in (1, 6, 16, 17, 24, 48, 96)] == [16] * 3 + [64] * 4
    assert td._launch_config(6, 128, bf16, big_smem=True, n_keys=32768)["num_stages"] == 2
    assert td._launch_config(6, 128, bf16, big_smem=True, n_keys=512)["num_stages"] == 3
    assert td._launch_config(6, 128, bf16, big_smem=False, n_keys=512)["num_stages"] == 2
    assert td._launch_config(24, 128, bf16, big_smem=True, n_keys=32768)["num_stages"] == 3
    assert td._launch_config(24, 128, torch.float32, big_smem=True, n_keys=512)["num_stages"] == 2
    # a gathered view at ≤ 16 rows, 16-bit, D ≤ 128: 128-key tiles in one stage (more gathered keys in flight)
    for big_smem in (False, True):
        cfg = td._launch_config(6, 128, bf16, big_smem=big_smem, n_keys=512, view=True)
        assert (cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"], cfg["BLOCK_R"]) == (128, 1, 4, 64)
    assert td._launch_config(6, 64, torch.float16, n_keys=512, view=True)["BLOCK_N"] == 128
    for m, d, dt in ((24, 128, bf16), (6, 128, torch.float32), (6, 256, bf16)):  # else as without a view
        assert td._launch_config(m, d, dt, True, 512, view=True) == td._launch_config(m, d, dt, True, 512)
    for m, d, dt, view in itertools.product((1, 24), (64, 128, 256), (bf16, torch.float32), (False, True)):
        cfg = td._launch_config(m, d, dt, big_smem=True, view=view)
        assert cfg["BLOCK_R"] <= 64 and 64 % cfg["BLOCK_R"] == 0 and cfg["BLOCK_R"] <= cfg["BLOCK_N"]


def test_plan_picks_the_paged_variant():
    """No table: the dense variant. A table: per-key lookups, or one per context tile where page_size is
    a multiple of the key tile (64 for bf16 at D = 64, 32 for fp32) and the context is not a gathered
    view; the split count's static bound is the table's logical capacity (W · page_size)."""
    gen = torch.Generator().manual_seed(6)

    def plan(page_size, dtype=torch.bfloat16, view=False, width=4):
        q, k, v, lengths = make_inputs(gen, B=2, Hq=4, Hkv=2, T=1, D=64, lengths=[5, 9], dtype=dtype)
        table = None
        if page_size:
            k = v = torch.zeros(7, 2, page_size, 64, dtype=dtype)
            table = torch.zeros(2, width, dtype=torch.int32)
        ci = torch.zeros(2, 1, 3, dtype=torch.int64) if view else None
        p = td._Plan(q, k, v, lengths, 0, None, ci, None if ci is None else ci.bool(), None, None, None, None, table)
        assert p.consts["PREFETCH"] == p.consts["PAGE_TILES"]  # (the default lookup: a tile ahead)
        return p.consts["PAGED"], p.consts["PAGE_TILES"]

    assert plan(None) == (False, False)
    assert [plan(ps) for ps in (1, 3, 48, 96)] == [(True, False)] * 4
    assert [plan(ps) for ps in (64, 128, 256)] == [(True, True)] * 3
    assert plan(32) == (True, False) and plan(32, torch.float32) == (True, True)
    assert plan(128, view=True) == (True, False)
    q = torch.zeros(64, 12, 1, 128, dtype=torch.bfloat16)
    pages = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16).expand(64 * 128, 2, 256, 128)  # 32K per row
    splits = td.num_splits_for(
        q, pages, pages, torch.zeros(64, dtype=torch.int64), block_table=torch.zeros(64, 128, dtype=torch.int32)
    )
    assert splits == td.default_num_splits(128 * 256, 64 * 2, td._num_sms(q.device), 16)
    # a gathered view splits by its own, smaller minimum (VIEW_SPLIT_KEYS keys a split, not 1024): on the
    # interpreter's 4 "SMs" (12 slots), 4 rows × 2 KV heads over a 512-key view take 4 splits, the same
    # rows over 512 contiguous slots one
    q = torch.zeros(4, 12, 1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(4, 1, 512, dtype=torch.int64)
    view = td.num_splits_for(
        q,
        pages,
        pages,
        torch.zeros(4, dtype=torch.int64),
        ctx_idx=idx,
        ctx_valid=idx.bool(),
        block_table=torch.zeros(4, 128, dtype=torch.int32),
    )
    # (the view's 128-key tiles: 3 splits would leave one empty, so 4)
    assert view == td.default_num_splits(512, 4 * 2, 4, 16, None, td.VIEW_SPLIT_KEYS, 128) == 4
    contiguous = td.num_splits_for(
        q,
        pages[:, :, :128],
        pages[:, :, :128],
        torch.zeros(4, dtype=torch.int64),
        block_table=torch.zeros(4, 4, dtype=torch.int32),
    )
    assert contiguous == 1


def test_supported_and_import_without_triton(monkeypatch):
    q = torch.zeros(1, 2, 1, 64)
    assert not td.supported(q, torch.zeros(1, 2, 8, 64))  # CPU tensors: the caller falls back
    mod = import_without_triton(monkeypatch, td)
    assert mod.triton is None and not mod.supported(q, torch.zeros(1, 2, 8, 64))
    assert not mod.available(torch.device("cpu"), torch.bfloat16, 64)


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter child run")
def test_interpreter_suite():
    """Run this file's kernel cases on the CPU through Triton's interpreter, in a child pytest."""
    run_in_triton_interpreter(__file__)


def test_metadata_packs_the_mask_once_per_forward():
    """Every layer's kernel call gets the same packed words (one pack per forward, not per layer)."""
    mask = torch.tril(torch.ones(3, 5, dtype=torch.bool), diagonal=2)
    meta = reference.AttentionMetadata(lengths=torch.tensor([4]), num_new=3, pending=2, new_mask=mask)
    first = meta.packed_new_mask()
    assert first is meta.packed_new_mask() and torch.equal(first, td.pack_new_mask(mask))
    assert reference.AttentionMetadata(lengths=torch.tensor([4]), num_new=1).packed_new_mask() is None


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the occupancy of a compiled kernel)")
def test_split_count_uses_the_compiled_variants_occupancy():
    """On a GPU the split count comes from the compiled kernel's resident programs per SM (registers and
    shared memory), read once per variant without launching it; the call's result is unchanged."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, lengths = make_inputs(gen, B=8, Hq=12, Hkv=2, T=4, D=128, lengths=[3000] * 8, cap=4096)
    q, k, v, lengths = to_device(q, k, v, lengths)
    splits = td.num_splits_for(q, k, v, lengths)
    per_sm = [n for key, n in td._OCCUPANCY.items() if key[2] and dict(key[2])["BLOCK_M"] == 64]
    assert per_sm and all(isinstance(n, int) and n >= 1 for n in per_sm)
    assert splits == td.default_num_splits(4096, 8 * 2, td._num_sms(q.device), 64, per_sm[-1])
    ref = reference_attention(*(x.cpu() for x in (q, k, v, lengths)))
    out = td.decode_attention(q, k, v, lengths).double().cpu()
    assert ((out - ref).norm() / ref.norm()).item() <= TOL[q.dtype]
