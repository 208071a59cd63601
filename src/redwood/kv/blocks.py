"""The block pool of a paged KV cache, and the block table of each request.

Terms.
- A *block* holds the KV of `block_size` consecutive token positions of one request; blocks are named by
  their ids 0..num_blocks-1 (the device cache is indexed by them; this module holds no tensors).
- A request's *block table* lists its blocks in position order: position p lives in block
  `blocks[p // block_size]` at offset `p % block_size`. Its *capacity* is len(blocks) * block_size.
- A block's *refcount* is the number of block tables holding it. It is *free* at refcount 0 and *used*
  above; `num_free + num_used == num_blocks` always.

Prefix cache (enable_prefix_cache=True). A block full of computed prompt tokens can be *registered*
under a chained hash: hash(parent block's hash, the block's token ids), the first block's parent being
None. Equal hashes mean equal token prefixes up to and including the block, hence equal KV, so a later
request whose prompt starts with the same tokens *matches* those blocks and shares them (refcount + 1
per sharer) instead of computing them. Sharing rules:
- only full blocks are registered, so no request ever writes into a shared block (its writes start at
  the first position past its matched blocks);
- a match never covers the whole prompt: the last prompt token is always computed, since its logits
  sample the first generated token — at most (len(token_ids) - 1) // block_size blocks match;
- a registered block whose refcount drops to 0 keeps its hash and is *evictable*: `allocate` hands out
  never-registered free blocks first, then evicts evictable blocks least recently freed first (dropping
  their hashes). `free` releases a table's blocks last to first, so a prefix chain's tail is evicted
  before its head (a chain whose head is gone can no longer be matched).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """`allocate` asked for more blocks than are free (check `can_allocate` first)."""


def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The prefix-cache key of a block: a 128-bit digest of its parent's key and its token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._refcount = [0] * num_blocks
        self._plain_free: deque[int] = deque(range(num_blocks))  # free blocks with no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free registered blocks, oldest first
        self._hash_of: dict[int, int] = {}  # block id -> its registered hash
        self._block_of: dict[int, int] = {}  # registered hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._plain_free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered hash (used or evictable)."""
        return len(self._block_of)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash_of.get(block)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks at refcount 1 (never-registered free blocks first, then the oldest evictable)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} of {self.num_blocks} are free")
        out = []
        for _ in range(n):
            if self._plain_free:
                block = self._plain_free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refcount[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block (last to first); a block at refcount 0 becomes free."""
        wanted: dict[int, int] = {}
        for block in blocks:  # check everything before changing anything
            if not (isinstance(block, int) and 0 <= block < self.num_blocks):
                raise ValueError(f"free: {block!r} is not a block id of this pool (0..{self.num_blocks - 1})")
            wanted[block] = wanted.get(block, 0) + 1
            if wanted[block] > self._refcount[block]:
                raise ValueError(
                    f"free: block {block} is freed more often than it is held (refcount {self._refcount[block]})"
                )
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._plain_free.append(block)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The longest run of registered blocks that starts token_ids, leaving its last token uncovered.

        The caller now holds the returned blocks (each refcount + 1). [] with the prefix cache off.
        """
        if not self.enable_prefix_cache:
            return []
        out, parent, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            out.append(block)
        for block in out:
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
        return out

    def register(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Record that block_id holds the computed KV of token_ids (a full block) after parent_hash's.

        Returns the block's chained hash, the parent of the next block. If another block already holds
        this hash (two requests computed the same prefix side by side), that one stays the cached copy
        and block_id stays unregistered. A no-op (but for the hash) with the prefix cache off.
        """
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"register: only full blocks are shared; got {len(token_ids)} tokens for a block of {self.block_size}"
            )
        if self._refcount[block_id] == 0:
            raise ValueError(f"register: block {block_id} is free")
        h = chain_hash(parent_hash, token_ids)
        if not self.enable_prefix_cache:
            return h
        old = self._hash_of.get(block_id)
        if old is not None and old != h:
            raise ValueError(f"register: block {block_id} already holds other tokens")
        if old is None and h not in self._block_of:
            self._hash_of[block_id] = h
            self._block_of[h] = block_id
        return h


class BlockTable:
    """The blocks of one request, in position order, and the chained hashes of its registered prefix."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # hashes[i]: prefix-cache hash of blocks[i], for the leading blocks

    @property
    def capacity(self) -> int:
        """Token positions the table covers."""
        return len(self.blocks) * self.block_size

    def ensure(self, num_tokens: int, pool: BlockPool) -> bool:
        """Grow so that capacity >= num_tokens; False (allocating nothing) if the pool is short."""
        need = pool.blocks_for(num_tokens) - len(self.blocks)
        if need <= 0:
            return True
        if not pool.can_allocate(need):
            return False
        self.blocks.extend(pool.allocate(need))
        return True

    def match_prefix(self, token_ids: Sequence[int], pool: BlockPool) -> int:
        """Start an empty table with token_ids' cached prefix blocks; returns the tokens they cover."""
        if self.blocks:
            raise ValueError("match_prefix: the table already holds blocks")
        self.blocks = pool.match_prefix(token_ids)
        self.hashes = [pool.block_hash(b) for b in self.blocks]
        return self.capacity

    def register_full(self, token_ids: Sequence[int], num_tokens: int, pool: BlockPool) -> None:
        """Register every not yet registered block lying wholly within token_ids[:num_tokens]."""
        bs = self.block_size
        for i in range(len(self.hashes), min(num_tokens, len(token_ids)) // bs):
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(pool.register(self.blocks[i], parent, token_ids[i * bs : (i + 1) * bs]))

    def release(self, pool: BlockPool) -> None:
        """Free every block and empty the table."""
        pool.free(self.blocks)
        self.blocks, self.hashes = [], []

    def slot(self, position: int) -> tuple[int, int]:
        """(block id, offset in the block) of a token position."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} is outside the table's {self.capacity} positions")
        return self.blocks[position // self.block_size], position % self.block_size
