"""The reference attention on the CPU scores each query like the one-token step that would produce its
token, bit for bit (what keeps greedy speculation == greedy AR where the packed CPU weights round
activations to bfloat16), and still computes the masked attention it always did."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from redwood.attention import reference
from redwood.attention.reference import attention

Hq, Hkv, D = 6, 2, 32


def _sdpa(q, k, v, mask):  # the plain masked call (per-query-head mask), for the semantics
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _chain_mask(lengths, T, S):
    """Row b's token t sees slots [0, lengths[b] + t]."""
    slot = torch.arange(S)
    return (slot[None, None, :] <= (torch.tensor(lengths)[:, None, None] + torch.arange(T)[None, :, None]))[:, None]


def test_a_verify_row_equals_the_one_token_step_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    lengths, T = [37, 90], 5
    S = max(lengths) + T
    q = torch.randn(2, Hq, T, D, generator=g)
    k, v = torch.randn(2, Hkv, S, D, generator=g), torch.randn(2, Hkv, S, D, generator=g)
    out = attention(q, k, v, _chain_mask(lengths, T, S))
    for b, L in enumerate(lengths):
        for t in range(T):
            # the decode step of this token: one query over exactly the keys written so far, read with
            # another batch (row b alone) and another read length (masked slots past it)
            n = L + t + 1
            extra = 7
            kk = torch.cat([k[b : b + 1, :, :n], torch.randn(1, Hkv, extra, D, generator=g)], 2)
            vv = torch.cat([v[b : b + 1, :, :n], torch.randn(1, Hkv, extra, D, generator=g)], 2)
            m = (torch.arange(n + extra) < n)[None, None, None]
            step = attention(q[b : b + 1, :, t : t + 1], kk, vv, m)
            assert torch.equal(out[b : b + 1, :, t : t + 1], step)
    # the same attention as the one masked call (semantics unchanged), to float rounding
    torch.testing.assert_close(out, _sdpa(q, k, v, _chain_mask(lengths, T, S)), atol=1e-6, rtol=1e-6)


def test_the_per_query_path_is_row_exact_where_the_masked_call_need_not_be():
    """Why the per-query path exists: SDPA's rows of a T-token call may differ in the last bits from one-token
    calls (they do on the AVX-512 machines this was measured on; whether they do depends on the CPU's kernels,
    so that is not asserted). The per-query path's rows equal the one-token steps bit for bit on every CPU
    (what makes a verify compute exactly the AR steps it stands for)."""
    g = torch.Generator().manual_seed(0)
    T, S = 4, 300
    q = torch.randn(1, 12, T, 128, generator=g)
    k, v = torch.randn(1, 2, S, 128, generator=g), torch.randn(1, 2, S, 128, generator=g)
    mask = _chain_mask([S - T], T, S)
    full = _sdpa(q, k, v, mask)
    rows = torch.cat(
        [_sdpa(q[:, :, t : t + 1], k[:, :, : S - T + t + 1], v[:, :, : S - T + t + 1], None) for t in range(T)], 2
    )
    torch.testing.assert_close(full, rows, atol=1e-5, rtol=1e-5)  # (the same attention, to float rounding)
    # the per-query path: each row bit for bit its one-token step's (which is not SDPA's kernel but the same
    # attention to float rounding)
    steps = torch.cat(
        [
            attention(
                q[:, :, t : t + 1],
                k[:, :, : S - T + t + 1],
                v[:, :, : S - T + t + 1],
                torch.ones(1, 1, 1, S - T + t + 1, dtype=torch.bool),
            )
            for t in range(T)
        ],
        2,
    )
    assert torch.equal(attention(q, k, v, mask), steps)
    torch.testing.assert_close(steps, rows, atol=1e-6, rtol=1e-6)


def test_a_tree_node_equals_the_step_over_its_path():
    """Tree verify: a node sees the context and its ancestors only; its row equals the one-token step
    over the context followed by its path, contiguous (as AR would have written them)."""
    g = torch.Generator().manual_seed(1)
    L = 20
    parents = [-1, 0, 0, 1, 2]  # node i's parent among the new tokens
    T = len(parents)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        while p >= 0:
            anc[i, p] = True
            p = parents[p]
    S = L + T
    mask = torch.cat([torch.ones(T, L, dtype=torch.bool), anc], 1)[None, None]
    q = torch.randn(1, Hq, T, D, generator=g)
    k, v = torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    out = attention(q, k, v, mask)
    for i in range(T):
        path = [L + j for j in range(T) if anc[i, j]]
        keys = list(range(L)) + path
        step = attention(
            q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], torch.ones(1, 1, 1, len(keys), dtype=torch.bool)
        )
        assert torch.equal(out[:, :, i : i + 1], step)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=1e-6, rtol=1e-6)


def test_windows_views_and_empty_rows():
    g = torch.Generator().manual_seed(2)
    T, S = 3, 40
    q = torch.randn(2, Hq, T, D, generator=g)
    k, v = torch.randn(2, Hkv, S, D, generator=g), torch.randn(2, Hkv, S, D, generator=g)
    mask = _chain_mask([30, 30], T, S)
    mask[0, :, :, :12] = False  # a sliding window: a contiguous range not starting at 0
    mask[1, :, :, 5:9] = False  # a gap (a compressed view): gathered keys
    mask[1, :, 2] = False  # a query that sees nothing: 0, not NaN
    out = attention(q, k, v, mask)
    assert torch.equal(out[1, :, 2], torch.zeros(Hq, D))
    ref = _sdpa(q, k, v, mask)
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[1, :, :2], ref[1, :, :2], atol=1e-6, rtol=1e-6)


def test_long_forwards_and_per_head_masks_keep_the_one_call():
    """Prefill chunks (more than BY_QUERY_MAX_NEW tokens) and per-KV-head masks (SnapKV draft views) take
    the single masked call."""
    g = torch.Generator().manual_seed(3)
    T = reference.BY_QUERY_MAX_NEW + 1
    q = torch.randn(1, Hq, T, D, generator=g)
    k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    mask = _chain_mask([0], T, T)
    assert torch.equal(attention(q, k, v, mask), _sdpa(q, k, v, mask))
    per_head = mask.expand(1, Hkv, T, T).clone()
    per_head[0, 1, :, 0] = False
    torch.testing.assert_close(
        attention(q[:, :, :4], k, v, per_head[:, :, :4]),
        _sdpa(q[:, :, :4], k, v, per_head[:, :, :4].repeat_interleave(Hq // Hkv, 1)),
    )


@pytest.mark.parametrize("T", [1, 4])
def test_batch_rows_do_not_depend_on_each_other(T):
    """A row's output is the same alone or beside a longer row (another read length)."""
    g = torch.Generator().manual_seed(4)
    S = 64 + T
    q = torch.randn(2, Hq, T, D, generator=g)
    k, v = torch.randn(2, Hkv, S, D, generator=g), torch.randn(2, Hkv, S, D, generator=g)
    both = attention(q, k, v, _chain_mask([10, 64], T, S))
    alone = attention(q[:1], k[:1, :, : 10 + T], v[:1, :, : 10 + T], _chain_mask([10], T, 10 + T))
    assert torch.equal(both[:1], alone)


def test_the_query_plan_is_read_once_per_mask_and_gives_the_same_outputs():
    """reference.query_keys: per query its contiguous range, its gathered slots, or nothing; attention with
    a forward's metadata keeps the plan for the mask every layer shares (a new mask gets its own), and a
    decode step (B = T = 1) is one `_one_query` call — the same outputs as planning every call."""
    from redwood.attention.reference import AttentionMetadata, query_keys

    g = torch.Generator().manual_seed(5)
    T, S = 3, 40
    mask = _chain_mask([30, 30], T, S)
    mask[1, :, :, 5:9] = False
    mask[1, :, 2] = False
    plan = query_keys(mask, (2, T, S))
    assert plan[0] == [(0, 31, None), (0, 32, None), (0, 33, None)] and plan[1][2] is None
    lo, hi, idx = plan[1][0]
    assert (lo, hi) == (0, 31) and idx.tolist() == [i for i in range(31) if not 5 <= i < 9]
    q = torch.randn(2, Hq, T, D, generator=g)
    k, v = torch.randn(2, Hkv, S, D, generator=g), torch.randn(2, Hkv, S, D, generator=g)
    meta = AttentionMetadata(lengths=torch.tensor([30, 30]), num_new=T)
    out = attention(q, k, v, mask)
    assert torch.equal(attention(q, k, v, mask, meta), out) and meta._query_keys[0] is mask
    assert torch.equal(attention(q, k, v, mask, meta), out)  # (the kept plan)
    other = _chain_mask([20, 25], T, S)
    assert torch.equal(attention(q, k, v, other, meta), attention(q, k, v, other))
    assert meta._query_keys[0] is other
    step_mask = _chain_mask([17], 1, S)  # a decode step: one call over the slice
    one = attention(q[:1, :, :1], k[:1], v[:1], step_mask, AttentionMetadata(lengths=torch.tensor([17]), num_new=1))
    assert torch.equal(one, reference._one_query(q[:1, :, :1], k[:1, :, :18], v[:1, :, :18]))
    torch.testing.assert_close(
        one,
        F.scaled_dot_product_attention(q[:1, :, :1], k[:1, :, :18], v[:1, :, :18], enable_gqa=True),
        atol=1e-6,
        rtol=1e-6,
    )
    broadcast = _chain_mask([17], 1, S)  # a mask broadcast over the rows
    assert torch.equal(
        attention(q[:, :, :1], k, v, broadcast), attention(q[:, :, :1], k, v, broadcast.expand(2, -1, -1, -1))
    )
