"""Continuation counts of n-grams: what the suffix drafter (`speculation.suffix`) ranks a node's children by.

Terms. For an n-gram g (min_n ≤ n ≤ max_n tokens) that occurred with a token t right after it, t is a
*continuation* of g; its *count* is how often, its *last seen* the clock of its latest occurrence. A
lookup ranks g's continuations by (count, last seen), both descending: the most frequent first, ties to the
most recent.

- `Continuations`: one n-gram's continuations — exact counts of every one, and the best `RANKED` kept in
  rank order as they change (a count only grows, and the token that grows is the newest, so its rank only
  rises: one O(RANKED) list update per occurrence, no sort at lookup).
- `NgramTable`: n-gram → `Continuations`, fed token by token.
- `SuffixIndex`: one request's tokens (prompt + output) and their table, grown as the request generates.
- `SharedIndex`: the tokens of recent requests (each its own sequence: no n-gram spans two requests),
  bounded to `capacity` tokens by generations: a young table takes new requests until it holds
  capacity / 2 tokens, then becomes the old table and the previous old one is dropped — oldest out, at
  most `capacity` tokens held, and no count ever decremented.
- `ranked_children(sources, tail, k)`: up to k distinct next tokens for a context ending in `tail`: the
  continuations of its longest suffix that has any (max_n down to min_n tokens), each source in turn (a
  request's own index before the shared one), then those of shorter suffixes to fill what is left.

Complexity. Adding a token: max_n − min_n + 1 dictionary probes, each with an O(RANKED) list update —
O(new tokens × max_n) for a request however long its context. A lookup: at most max_n − min_n + 1 probes
per source, O(RANKED) each (the shared index merges its two generations' ranked lists: O(RANKED log
RANKED)) — independent of the context length. Memory: max_n − min_n + 1 entries per token indexed.
"""

from __future__ import annotations

from collections.abc import Sequence

from redwood.errors import ConfigError
from redwood.speculation.draftless import check_ngram_sizes

RANKED = 8  # continuations kept in rank order per n-gram: the most children one n-gram gives a node
DEFAULT_SHARED_CAPACITY = 1 << 16  # tokens the shared index holds at most (two generations of half each)


class Continuations:
    """The tokens seen after one n-gram: [count, last seen] of each, and the best RANKED in rank order."""

    __slots__ = ("stats", "top")

    def __init__(self):
        self.stats: dict[int, list[int]] = {}  # token → [count, last seen]
        self.top: list[int] = []  # ≤ RANKED tokens, best first

    def add(self, token: int, clock: int) -> None:
        """One more occurrence of `token` after the n-gram, at `clock` (newer than every earlier one)."""
        s = self.stats.get(token)
        if s is None:
            s = self.stats[token] = [0, 0]
        s[0] += 1
        s[1] = clock
        top = self.top
        if token in top:
            top.remove(token)
        # newest: it goes before every token of its count or less (ties by recency), after the rest
        at = next((i for i, t in enumerate(top) if self.stats[t][0] <= s[0]), len(top))
        if at < RANKED:
            top.insert(at, token)
            del top[RANKED:]

    def count(self, token: int) -> int:
        s = self.stats.get(token)
        return 0 if s is None else s[0]


class NgramTable:
    """n-gram (a tuple of min_n … max_n tokens) → its `Continuations`."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.grams: dict[tuple[int, ...], Continuations] = {}

    def add(self, tokens: Sequence[int], i: int, clock: int) -> None:
        """Register tokens[i] as the continuation of each n-gram ending just before it."""
        t = tokens[i]
        for n in range(self.min_n, min(self.max_n, i) + 1):
            key = tuple(tokens[i - n : i])
            c = self.grams.get(key)
            if c is None:
                c = self.grams[key] = Continuations()
            c.add(t, clock)

    def ranked(self, key: tuple[int, ...]) -> list[int]:
        c = self.grams.get(key)
        return [] if c is None else c.top


class SuffixIndex:
    """One request's tokens and the continuation counts of their n-grams (clock: the token's position)."""

    def __init__(self, min_n: int, max_n: int):
        check_ngram_sizes(min_n, max_n)
        self.tokens: list[int] = []
        self.table = NgramTable(min_n, max_n)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            self.table.add(self.tokens, len(self.tokens) - 1, len(self.tokens))

    def ranked(self, key: tuple[int, ...]) -> list[int]:
        return self.table.ranked(key)


class SharedIndex:
    """Continuation counts over the tokens of recent requests, at most `capacity` tokens (see the module
    docstring: two generations, the older dropped whole when the younger fills)."""

    def __init__(self, min_n: int, max_n: int, capacity: int = DEFAULT_SHARED_CAPACITY):
        check_ngram_sizes(min_n, max_n)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 2:
            raise ConfigError(f"the shared index's capacity must be an integer >= 2 tokens, got {capacity!r}")
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.young, self.old = NgramTable(min_n, max_n), NgramTable(min_n, max_n)
        self.young_tokens = self.old_tokens = 0
        self.clock = 0  # across requests: recency ranks a newer request's continuation first

    @property
    def size(self) -> int:
        """Tokens held (≤ capacity)."""
        return self.young_tokens + self.old_tokens

    def add(self, tokens: Sequence[int]) -> None:
        """A request's tokens (its last capacity / 2 if longer), as one sequence."""
        half = self.capacity // 2
        tokens = [int(t) for t in tokens[-half:]]
        if self.young_tokens + len(tokens) > half:  # the young generation is full: it becomes the old one
            self.old, self.old_tokens = self.young, self.young_tokens
            self.young, self.young_tokens = NgramTable(self.min_n, self.max_n), 0
        for i in range(len(tokens)):
            self.clock += 1
            self.young.add(tokens, i, self.clock)
        self.young_tokens += len(tokens)

    def ranked(self, key: tuple[int, ...]) -> list[int]:
        young, old = self.young.grams.get(key), self.old.grams.get(key)
        if young is None or old is None:
            one = young or old
            return [] if one is None else one.top

        def score(t: int) -> tuple[int, int]:  # (count over both generations, last seen)
            seen = young.stats.get(t) or old.stats[t]  # (the young generation's is the newer)
            return (young.count(t) + old.count(t), seen[1])

        return sorted(dict.fromkeys(young.top + old.top), key=score, reverse=True)[:RANKED]


def ranked_children(sources: Sequence, tail: tuple[int, ...], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k distinct next tokens after a context ending in `tail` (its last max_n tokens or fewer): for
    each suffix length n from the longest down to min_n, each source's ranked continuations of that
    n-gram, in order, skipping tokens already taken. [] when no suffix of min_n tokens or more was seen."""
    out: list[int] = []
    for n in range(min(max_n, len(tail)), min_n - 1, -1):
        key = tail[len(tail) - n :]
        for source in sources:
            for t in source.ranked(key):
                if t not in out:
                    out.append(t)
                    if len(out) == k:
                        return out
    return out
