"""Block pool and block tables: accounting, refcounts, the prefix cache and its LRU eviction."""

import random

import pytest

from redwood.kv.blocks import BlockPool, BlockTable, OutOfBlocks, chain_hash


def test_allocate_free_accounting():
    pool = BlockPool(8, 4)
    assert (pool.num_free, pool.num_used) == (8, 0)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and (pool.num_free, pool.num_used) == (5, 3)
    assert pool.allocate(0) == []
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    assert not pool.can_allocate(1) and pool.can_allocate(0)
    with pytest.raises(OutOfBlocks, match="asked for 1 KV blocks, 0 of 8"):
        pool.allocate(1)
    pool.free(a)
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert all(pool.refcount(x) == 0 for x in a) and all(pool.refcount(x) == 1 for x in b)
    pool.free(b)
    assert pool.num_free == 8
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_blocks_for():
    pool = BlockPool(4, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_free_errors_change_nothing():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="block 2 is freed more often than it is held"):
        pool.free([blocks[0], 2])
    with pytest.raises(ValueError, match="not a block id of this pool"):
        pool.free([blocks[0], 7])
    with pytest.raises(ValueError, match="not a block id"):
        pool.free([-1])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([blocks[0], blocks[0]])
    assert pool.refcount(blocks[0]) == 1 and pool.num_used == 2  # the failed calls freed nothing
    pool.free(blocks)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([blocks[0]])


def test_bad_pool():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_block_table_ensure_release_slot():
    pool = BlockPool(5, 4)
    t = BlockTable(4)
    assert t.ensure(0, pool) and t.blocks == []
    assert t.ensure(5, pool) and len(t.blocks) == 2 and t.capacity == 8
    assert t.ensure(8, pool) and len(t.blocks) == 2  # already covered
    assert t.slot(0) == (t.blocks[0], 0) and t.slot(5) == (t.blocks[1], 1) and t.slot(7) == (t.blocks[1], 3)
    with pytest.raises(IndexError):
        t.slot(8)
    with pytest.raises(IndexError):
        t.slot(-1)
    before = list(t.blocks)
    assert not t.ensure(21, pool)  # needs 4 more, 3 free: allocates nothing
    assert t.blocks == before and pool.num_free == 3
    assert t.ensure(20, pool) and pool.num_free == 0
    t.release(pool)
    assert t.blocks == [] and t.capacity == 0 and pool.num_free == 5


def test_prefix_cache_off_matches_nothing():
    pool = BlockPool(4, 2)
    t = BlockTable(2)
    t.ensure(4, pool)
    t.register_full([1, 2, 3, 4, 5], 4, pool)
    assert pool.num_cached == 0 and pool.match_prefix([1, 2, 3, 4, 5]) == []


def _filled(pool, tokens, num_computed=None):
    """A table holding tokens, with its full computed blocks registered."""
    t = BlockTable(pool.block_size)
    t.num = t.match_prefix(tokens, pool)
    assert t.ensure(len(tokens), pool)
    t.register_full(tokens, len(tokens) if num_computed is None else num_computed, pool)
    return t


def test_prefix_sharing_and_refcounts():
    pool = BlockPool(10, 2, enable_prefix_cache=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 3 full blocks + 1 token
    a = _filled(pool, prompt)
    assert pool.num_cached == 3 and len(a.hashes) == 3
    assert a.hashes[0] == chain_hash(None, [5, 6]) and a.hashes[1] == chain_hash(a.hashes[0], [7, 8])
    b = _filled(pool, prompt[:6] + [99, 98])  # shares the first 3 blocks, matches them all
    assert b.num == 6 and b.blocks[:3] == a.blocks[:3] and b.blocks[3] != a.blocks[3]
    assert [pool.refcount(x) for x in a.blocks] == [2, 2, 2, 1]
    c = _filled(pool, [5, 6, 0, 0, 9])  # diverges in block 1: only block 0 matches
    assert c.num == 2 and c.blocks[0] == a.blocks[0] and pool.refcount(a.blocks[0]) == 3
    d = _filled(pool, [7, 8, 9, 10, 1])  # same tokens as a's block 1, other parent: no match
    assert d.num == 0 and d.blocks[0] != a.blocks[1]
    for t in (a, b, c, d):
        t.release(pool)
    assert pool.num_free == 10 and pool.num_used == 0


def test_never_match_the_whole_prompt():
    pool = BlockPool(10, 2, enable_prefix_cache=True)
    a = _filled(pool, [1, 2, 3, 4])
    assert pool.num_cached == 2
    # The same 4-token prompt: its last token must be computed, so only block 0 is matched.
    assert pool.match_prefix([1, 2, 3, 4]) == [a.blocks[0]]
    assert pool.match_prefix([1, 2, 3]) == [a.blocks[0]]
    assert pool.match_prefix([1, 2]) == []
    assert pool.match_prefix([1]) == [] and pool.match_prefix([]) == []
    assert pool.match_prefix([1, 2, 3, 4, 5]) == a.blocks[:2]


def test_partial_blocks_are_never_registered():
    pool = BlockPool(10, 4, enable_prefix_cache=True)
    t = _filled(pool, [1, 2, 3, 4, 5, 6], num_computed=6)  # block 1 holds 2 of 4 tokens
    assert pool.num_cached == 1 and len(t.hashes) == 1
    t2 = _filled(pool, [1, 2, 3, 4, 5, 6, 7, 8], num_computed=3)  # block 0 not yet fully computed
    assert t2.num == 4 and len(t2.hashes) == 1  # matched block 0, registered nothing new
    with pytest.raises(ValueError, match="only full blocks"):
        pool.register(t.blocks[1], t.hashes[0], [5, 6])


def test_register_errors_and_duplicates():
    pool = BlockPool(6, 2, enable_prefix_cache=True)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    h = pool.register(a, None, [1, 2])
    assert pool.register(a, None, [1, 2]) == h  # idempotent
    with pytest.raises(ValueError, match="already holds other tokens"):
        pool.register(a, None, [3, 4])
    # Two requests computed the same block side by side: the first stays the cached copy.
    assert pool.register(b, None, [1, 2]) == h and pool.block_hash(b) is None
    assert pool.match_prefix([1, 2, 3]) == [a]
    pool.free([a, a, b])
    with pytest.raises(ValueError, match="is free"):
        pool.register(b, None, [1, 2])


def test_evictable_blocks_stay_matchable_and_are_evicted_last():
    pool = BlockPool(6, 2, enable_prefix_cache=True)
    a = _filled(pool, [1, 2, 3, 4, 5])  # blocks 0, 1 registered, 2 plain
    a_blocks = list(a.blocks)
    a.release(pool)
    assert pool.num_free == 6 and pool.num_used == 0 and pool.num_cached == 2
    b = _filled(pool, [1, 2, 3, 4, 0])  # matched from the evictable set
    assert b.num == 4 and b.blocks[:2] == a_blocks[:2] and pool.num_used == 3
    b.release(pool)
    fresh = pool.allocate(4)  # the 4 never-registered free blocks come first
    assert not set(fresh) & set(a_blocks[:2]) and pool.num_cached == 2
    # Freed last to first: block 1 (the chain's tail) is older in the LRU order, so evicted first.
    assert pool.allocate(1) == [a_blocks[1]] and pool.num_cached == 1
    assert pool.match_prefix([1, 2, 3, 4, 5]) == [a_blocks[0]]  # the head still matches
    pool.free([a_blocks[0]])
    assert pool.allocate(1) == [a_blocks[0]] and pool.num_cached == 0
    assert pool.match_prefix([1, 2, 3, 4, 5]) == []


def test_lru_order_across_requests():
    pool = BlockPool(4, 2, enable_prefix_cache=True)
    x = _filled(pool, [1, 2, 0])  # block 0 registered under [1, 2], block 1 plain
    y = _filled(pool, [3, 4, 0])
    xb, yb = x.blocks[0], y.blocks[0]
    x.release(pool)
    y.release(pool)  # evictable, least recently freed first: x's, y's
    z = _filled(pool, [1, 2, 9])  # matching x's block takes it; freed again, it is the newest
    assert z.blocks[0] == xb
    z.release(pool)
    got = pool.allocate(2)  # the plain free blocks first
    assert not {xb, yb} & set(got)
    assert pool.allocate(1) == [yb]
    assert pool.match_prefix([3, 4, 0]) == [] and pool.match_prefix([1, 2, 0]) == [xb]


def test_random_pool_operations_keep_refcounts():
    rng = random.Random(0)
    pool = BlockPool(16, 2, enable_prefix_cache=True)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:
            pool.free(held.pop(rng.randrange(len(held))))
        elif rng.random() < 0.5:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            t = BlockTable(2)
            t.match_prefix(tokens, pool)
            if t.ensure(len(tokens), pool):
                t.register_full(tokens, len(tokens), pool)
                held.append(t.blocks)
            else:
                t.release(pool)
        else:
            n = rng.randrange(4)
            if pool.can_allocate(n):
                held.append(pool.allocate(n))
        counts = [0] * 16
        for blocks in held:
            for b in blocks:
                counts[b] += 1
        assert counts == [pool.refcount(b) for b in range(16)]
        assert pool.num_used == sum(c > 0 for c in counts) and pool.num_free + pool.num_used == 16
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == 16
