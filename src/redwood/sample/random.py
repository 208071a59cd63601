"""Counter-based random numbers per batch row, computed on the device (CUDA-graph capturable).

A `torch.Generator` keeps its state on the host, so drawing from one generator per row means one call
(and, for some ops, a host synchronization) per row, and a graph replay would repeat the same numbers.
`RowRandom` instead derives every number from (row seed, row draw counter, item, element) by an integer
hash evaluated with ordinary tensor ops. Each row has its own counter, a device tensor advanced in place
by every draw the row takes part in, so a captured step draws fresh numbers on every replay, and a row's
numbers depend only on its own seed and on how many draws it took part in — never on the other rows of
the batch, on draws that skipped it, or on when it joined (`reseed` gives a batch row a new request's
seed and a zero counter).

Hash: Chris Wellons' "lowbias32" integer finalizer (xor-shift / multiply rounds on 32-bit words), with
multipliers below 2^31 so that every product fits an int64 exactly on every device (no reliance on
wrap-around). A row's seed gives it two 32-bit keys; every item of a draw gets two words from them, its
counter and its lane; every element one or two hashes of those words. Uniforms: float32 from 24 hash
bits, float64 from 53 bits of two hashes (32 + 21). `tests/sample/test_random_streams.py` and
`benchmarks/random_battery.py` (dieharder) test the streams along every axis.

Streams. A draw gives each *item* (a node or a row) a block of elements; items of the same batch row get
consecutive lanes (0, 1, … in item order), so item i of row b always reads the same stream whatever else
is drawn with it.

Positional numbers (`positional`). Besides the counter streams, a row has one float64 number per
absolute token position, a hash of (row keys, position) alone: the counter is not involved. The sampler
draws the token at position P with the number at P (`Sampler.sample`), and the `match` verifier reads the
same numbers, so a seeded request gives the same tokens however its steps speculate.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x5BD1E995  # odd multipliers < 2^31: x · m < 2^63 for 32-bit x
_GOLDEN = 0x9E3779B9
# Domain tags of the positional numbers (`RowRandom.positional`): the row keys and the position are
# hashed with them first (keys: the first two, the position's low half: the last two).
_POSITION_TAGS = (0x3C6EF372, 0x1B873593, 0x6A09E667, 0x510E527F)


def _seed_keys(seeds: list[int | None], device) -> torch.Tensor:
    """Two 32-bit keys per seed (None → a random seed), each from both 32-bit halves of it: [len(seeds), 2].
    Together they fix the row's streams (each item word is drawn from one of them, every element from both)."""
    words = []
    for s in seeds:
        s = random.getrandbits(63) if s is None else int(s)
        words.append([(s >> 32) & _MASK32, s & _MASK32])
    w = torch.tensor(words, dtype=torch.long, device=device).view(-1, 2)
    return torch.stack(
        [mix32(mix32(w[:, 0] ^ 0x2545F491) ^ w[:, 1]), mix32(mix32(w[:, 1] ^ 0x6C8E9CF5) ^ w[:, 0])], dim=1
    )


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Hash int64 values holding 32-bit words → 32-bit words (int64), elementwise."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


class RowRandom:
    """Random numbers for B rows, row b seeded by seeds[b] (None → a random seed)."""

    def __init__(self, seeds: list[int | None], device: torch.device | str):
        self.key = _seed_keys(seeds, device)  # [B, 2] two 32-bit keys per row
        self.counter = torch.zeros(len(seeds), dtype=torch.long, device=device)  # [B] draws each row took
        self.batch_size = len(seeds)

    @property
    def device(self) -> torch.device:
        return self.key.device

    def uniform(
        self, rows: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Fresh U[0, 1) numbers [N, *shape]: item i belongs to batch row rows[i] (None → N = B, item b
        is row b). Advances the counter of every row that has an item (one draw per row per call)."""
        dev = self.key.device
        if rows is None:
            rows = torch.arange(self.batch_size, device=dev)
        rows = rows.to(dev)
        N = rows.numel()
        # lane: how many earlier items belong to the same row (sorting keeps it free of host syncs).
        ordered, order = rows.sort(stable=True)
        first = torch.searchsorted(ordered, ordered)  # [N] first position of each item's row in `ordered`
        lane = torch.empty_like(rows).scatter_(0, order, torch.arange(N, device=dev) - first)
        # Two 32-bit words per item from (row keys, row draw counter, lane), each through two rounds of
        # the bijective mixer: an item's stream is fixed by 64 bits, so no two items (other draws, other
        # lanes, other rows' seeds) share one but by a 2^-64 accident — no arithmetic relation between
        # (counter, lane) pairs aliases them, as counter · 0x10001 + lane did after 65,535 draws.
        c = self.counter[rows] & _MASK32
        x = mix32(mix32(self.key[rows, 0] ^ c) ^ lane)  # [N]
        y = mix32(mix32(self.key[rows, 1] ^ c) ^ ((lane * _GOLDEN) & _MASK32))
        numel = 1
        for s in shape:
            numel *= s
        u = _element_uniforms(x, y, numel, dtype)  # [N, numel]
        self.counter += torch.zeros_like(self.counter).index_fill_(0, rows, 1)  # (no host sync)
        return u.view(N, *shape)

    def positional(self, rows: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """float64 U[0, 1) numbers keyed by (row seed, absolute token position): item i gets the number of
        row rows[i] (None → rows[i] = i) at positions[i] (int64 ≥ 0, any shape, rows broadcast over its
        trailing dimensions when rows is [N] and positions [N, ...]). The counter is neither read nor
        advanced: the same (seed, position) gives the same number whatever was drawn before, whatever
        else is in the batch and whichever batch row the request sits in.

        Domain. A position's two item words are built as a counter item's, (key ^ counter, lane) through
        two rounds, but from the row keys and the position's low half each hashed first with tags used
        nowhere else (`_POSITION_TAGS`). For the pair to equal a counter item's of the same row, x fixes
        the counter, and y then needs mix32(lo ^ t2) ^ mix32(lo ^ t3) to hit one 32-bit value set by the
        seed — a ~2^-32 event per position with no arithmetic pattern (where xor-ing tags into the keys
        alone would, for one seed in 2^32, have made every position a re-indexed counter item), and the
        counter it names is a pseudo-random 32-bit number, far beyond any a request reaches. Each number
        is a hash of its pair, so the positional numbers are as unrelated to the counter streams as two
        counter items are to each other (`tests/sample/test_random.py` checks correlations and overlaps).
        """
        dev = self.key.device
        positions = positions.to(dev)
        if rows is None:
            rows = torch.arange(positions.shape[0], device=dev)
        rows = rows.to(dev)
        key = self.key[rows]  # [N, 2]
        key = key.view(*key.shape[:1], *([1] * (positions.dim() - 1)), 2)  # broadcast over positions' tail
        a = mix32(key[..., 0] ^ _POSITION_TAGS[0])
        b = mix32(key[..., 1] ^ _POSITION_TAGS[1])
        lo, hi = positions & _MASK32, (positions >> 32) & _MASK32
        x = mix32(mix32(a ^ mix32(lo ^ _POSITION_TAGS[2])) ^ hi)  # positions' shape
        y = mix32(mix32(b ^ mix32(lo ^ _POSITION_TAGS[3])) ^ ((hi * _GOLDEN) & _MASK32))
        return _element_uniforms(x.flatten(), y.flatten(), 1, torch.float64).view(positions.shape)

    def reseed(self, row: int, seed: int | None) -> None:
        """Batch row `row` starts a new stream: `seed`'s key, counter 0 (a request admitted to a slot)."""
        self.key[row] = _seed_keys([seed], self.key.device)[0]  # (both words)
        self.counter[row] = 0

    def state(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s (keys [2], counter) — to carry a preempted request's stream to its next slot."""
        return self.key[row].clone(), self.counter[row].clone()

    def set_state(self, row: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.key[row], self.counter[row] = state

    def copy(self) -> "RowRandom":
        other = RowRandom.__new__(RowRandom)
        other.key, other.counter, other.batch_size = self.key.clone(), self.counter.clone(), self.batch_size
        return other

    def load_state(self, other: "RowRandom") -> None:
        """Take another source's keys and counter into this one's tensors, in place."""
        self.key.copy_(other.key)
        self.counter.copy_(other.counter)

    def checkpoint(self) -> Callable[[], None]:
        """Remember the counter; the returned function puts it back (undoing the draws made since, e.g.
        by the warm-up runs before a graph capture)."""
        saved = self.counter.clone()
        return lambda: self.counter.copy_(saved)


def _element_uniforms(x: torch.Tensor, y: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Item words x, y [N] (32-bit, int64) → numel uniforms per item [N, numel] of `dtype`."""
    x, y = x[:, None], y[:, None]
    elem = torch.arange(numel, device=x.device)[None]  # [1, numel]
    # Element e: mix32(x ^ e) is distinct for every e of the item, and xor-ing the item's other word
    # before the last round keeps two items' element streams from being shifted copies of each other
    # (which item + e · const made them whenever two item words differed by a multiple of the const).
    h = mix32(mix32(x ^ elem) ^ y)  # [N, numel]
    if dtype == torch.float64:
        h2 = mix32(mix32(y ^ elem) ^ x)  # the low 21 bits: not a function of h's 32
        return ((h << 21) | (h2 >> 11)).double() * 2.0**-53
    if dtype == torch.float32:
        return (h >> 8).float() * 2.0**-24
    raise ValueError(f"uniforms are float32 or float64, not {dtype}")


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from each row of probs [M, V] with uniforms u [M] or [M, k] → indices of u's shape.

    Token i is drawn for u in [c_{i-1}, c_i) / c_V, c the cumulative sum of the row. The sums and the
    comparison are float64: with float32 sums a token's interval would be rounded to the float32 spacing
    of the sum before it (~6e-8 near 1, the size of a whole low-probability token); in float64 every
    interval is its token's float32 probability to ~1e-16. Pass float64 uniforms (`RowRandom`'s 53
    bits): float32 uniforms have a 2^-24 spacing, coarser than the probabilities of a large vocabulary's
    tail (benchmarks/inverse_cdf_bias.py).

    A token of probability 0 is never returned (its cumulative sum equals its predecessor's, so the first
    index whose cumulative sum exceeds the target value is never it; the end is clamped to the token at
    which the sum reaches its total, which has mass — a guard only: for u < 1 the target stays below the
    total). A row without mass is treated as uniform (token floor(u · V)).

    Cost: one float64 copy of probs and its cumulative sum in place, nothing else of the vocabulary's
    size (on the CPU every fresh [M, V] buffer is page-faulted in: a where() over probs and a flipped
    copy to find the last token with mass cost 4× the sum itself at a 152K vocabulary).
    """
    squeeze = u.dim() == 1
    if squeeze:
        u = u[:, None]
    u = u.double()
    cdf = probs.to(torch.float64, copy=True).cumsum_(-1)  # [M, V]
    total = cdf[:, -1:].contiguous()  # [M, 1]
    idx = torch.searchsorted(cdf, (u * total).contiguous(), right=True)
    idx = torch.minimum(idx, torch.searchsorted(cdf, total))  # (the first index where the sum is whole)
    V = probs.shape[-1]
    idx = torch.where(total > 0, idx, (u * V).long().clamp(max=V - 1))  # no mass (or NaN): uniform
    return idx[:, 0] if squeeze else idx
