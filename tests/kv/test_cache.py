"""The paged KV cache: a forward through random page tables equals the same forward over a dense cache."""

from __future__ import annotations

import pytest
import torch

from redwood.attention.reference import AttentionMetadata, read_kv
from redwood.config import ModelConfig
from redwood.kv.cache import KVCache
from redwood.kv.policies import StreamingPolicy
from tests.conftest import tiny_hf_config


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_hf_config("qwen2").to_dict())


def _paged_twin(dense: KVCache, page: int, seed: int) -> KVCache:
    """A paged cache holding the dense cache's rows on shuffled pages (plus never-used pages of NaN)."""
    cfg = _config()
    B, cap = dense.batch_size, dense.capacity
    width = -(-cap // page)
    num_pages = B * width + 3
    paged = KVCache.paged(cfg, B, num_pages, page, cap, torch.float32, "cpu")
    paged.k.fill_(float("nan"))
    paged.v.fill_(float("nan"))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)[: B * width].view(B, width)
    paged.block_table.copy_(perm.to(torch.int32))
    for b in range(B):
        for j in range(width):
            n = min(page, cap - j * page)
            paged.k[:, perm[b, j], :, :n] = dense.k[:, b, :, j * page : j * page + n]
            paged.v[:, perm[b, j], :, :n] = dense.v[:, b, :, j * page : j * page + n]
    paged.lengths.copy_(dense.lengths)
    paged.live.copy_(dense.live)
    return paged


@pytest.mark.parametrize("page", [1, 3, 8, 64])
@torch.inference_mode()
def test_paged_reads_and_writes_equal_dense(page):
    cfg = _config()
    B, cap = 3, 40
    dense = KVCache(cfg, B, cap, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    dense.k.copy_(torch.randn(dense.k.shape, generator=g))
    dense.v.copy_(torch.randn(dense.v.shape, generator=g))
    dense.lengths.copy_(torch.tensor([30, 7, 0]))
    paged = _paged_twin(dense, page, seed=page)
    # context reads and view gathers through the table
    meta = AttentionMetadata(lengths=dense.lengths, num_new=2, pending=1)
    for layer in range(cfg.num_layers):
        for a, b in zip(read_kv(dense, layer, meta)[:2], read_kv(paged, layer, meta)[:2]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    view = StreamingPolicy(2, 5).view(dense.lengths)
    meta = AttentionMetadata(lengths=dense.lengths, num_new=1, view=view)
    for a, b in zip(read_kv(dense, 0, meta)[:2], read_kv(paged, 0, meta)[:2]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # writes, tree compaction, commits
    slots = dense.slots(4)
    k = torch.randn(B, cfg.num_kv_heads, 4, cfg.head_dim, generator=g)
    for cache in (dense, paged):
        cache.write(1, cache.physical(slots), k, -k)
        cache.compact(torch.tensor([[0, 2, 3], [0, 1, 3], [0, 3, 3]]), torch.tensor([3, 2, 1]))
        cache.commit(torch.tensor([3, 2, 1]))
    assert paged.lengths.tolist() == dense.lengths.tolist() == [33, 9, 1]
    for layer in range(cfg.num_layers):
        ka, va = dense.context(layer, 33)
        kb, vb = paged.context(layer, 33)
        for b, n in enumerate(dense.lengths.tolist()):
            torch.testing.assert_close(kb[b, :, :n], ka[b, :, :n], rtol=0, atol=0)
            torch.testing.assert_close(vb[b, :, :n], va[b, :, :n], rtol=0, atol=0)


def test_slots_past_a_row_s_table_go_to_the_trash_page():
    cfg = _config()
    paged = KVCache.paged(cfg, 2, 4, 8, 16, torch.float32, "cpu")
    paged.block_table[0] = torch.tensor([2, 0], dtype=torch.int32)
    pages, offsets = paged.physical(torch.tensor([[0, 9, 15, 16, 40], [0, 1, 2, 3, 4]]))
    assert pages.tolist() == [[2, 0, 0, 4, 4], [4, 4, 4, 4, 4]] and paged.trash_page == 4
    assert offsets.tolist() == [[0, 1, 7, 0, 0], [0, 1, 2, 3, 4]]
    assert paged.k.shape[1] == 5  # the trash page is one more page


@torch.inference_mode()
def test_a_paged_row_on_the_cpu_reads_one_page_as_a_view():
    """context() of one row on the CPU: a view of its page while the slots fit in it, else one copy of its
    pages in table order — the dense cache's values either way."""
    cfg = _config()
    dense = KVCache(cfg, 1, 40, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    dense.k.copy_(torch.randn(dense.k.shape, generator=g))
    dense.v.copy_(torch.randn(dense.v.shape, generator=g))
    paged = _paged_twin(dense, 16, seed=2)
    for n in (5, 16, 17, 40):
        k, v = paged.context(1, n)
        assert k.shape == (1, cfg.num_kv_heads, n, cfg.head_dim)
        assert torch.equal(k, dense.context(1, n)[0]) and torch.equal(v, dense.context(1, n)[1])
        page = int(paged.block_table[0, 0])
        assert (k.untyped_storage().data_ptr() == paged.k.untyped_storage().data_ptr()) == (n <= 16)
        if n <= 16:
            assert k.data_ptr() == paged.k[1, page].data_ptr()
