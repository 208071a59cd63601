"""Draftless drafting: proposals copied from the request's own tokens (prompt lookup / n-gram matching).

No draft forward runs. Before a step, each generating row's history (prompt + output, ending with `last`)
is matched against itself: the longest suffix of `max_n` down to `min_n` tokens that occurred before, at
its most recent earlier occurrence, proposes the tokens that followed it (periodic text continues its
period). A row with no match proposes nothing; when no row of the step has a proposal the step runs
plainly (one token, no verification forward over guesses).

The proposal is deterministic, so its draft distribution is one-hot: speculative rejection sampling
accepts a proposed token x with probability p(x) and otherwise draws from p with x removed — exactly the
target's distribution at every temperature, like any other drafter's (`sample.chain_verify`).

The per-row index (`NgramIndex`) grows with the row's tokens: each new token registers the n-grams that end
just before it, so a lookup costs `max_n − min_n + 1` dictionary probes, whatever the context length (a prompt
is indexed in one vectorized pass).

`DraftlessDrafter` is what this drafter and the suffix-tree drafter (`speculation.suffix`) share: a host index
per row, grown before each step, and proposals handed to the step through a device buffer.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from redwood.errors import ConfigError
from redwood.kv.policies import FullPolicy
from redwood.speculation.drafters import Drafter
from redwood.speculation.trees import Tree

DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 4


def check_ngram_sizes(min_n, max_n) -> None:
    for name, v in (("ngram_min", min_n), ("ngram_max", max_n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if min_n > max_n:
        raise ConfigError(f"ngram_min ({min_n}) must be at most ngram_max ({max_n})")


# An n-gram's dictionary key: a multiplicative hash of (n, its tokens) modulo 2^64 — one int instead of a tuple,
# so a long prompt is indexed in a few vectorized passes (a 16K-token prompt: ~22 ms of tuples before, a few ms
# now: on a GPU server every new request's index was built inside a step). A lookup checks the tokens it finds,
# so a collision can only hide a match (never propose a wrong one: and proposals are verified anyway).
_HASH_MUL = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_BULK = 64  # tokens added at once from which the numpy path indexes them
_TAIL = 64  # unregistered tokens `propose` scans at most (more: it registers them first)


def _ngram_key(seq) -> int:
    h = len(seq)
    for t in seq:
        h = (h * _HASH_MUL + t) & _MASK
    return h


class NgramIndex:
    """One row's tokens and, for each n-gram of min_n..max_n tokens that has a token after it, where its
    most recent such occurrence ends (exclusive).

    Registering may lag the tokens (`append`, then `register` later): the n-grams ending at or past `indexed` are
    not in the dictionary yet, and `propose` scans that tail directly, newest first — it is more recent than
    anything registered, so the answers are the same as a fully registered index's. On a GPU the automatic policy
    appends a step's tokens before planning (cheap) and registers them in the job the device's next step covers:
    registering 64 rows' new tokens was the largest part of a 64-row plan's host time (~2 ms of ~4 on a 2-core
    CPU), and the tail it leaves to scan is one step's tokens."""

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N):
        check_ngram_sizes(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.indexed = 0  # the n-grams ending before this position are registered in `_end`
        self._end: dict[int, int] = {}  # `_ngram_key` → where its latest occurrence ends
        self._pow = [pow(_HASH_MUL, k, 1 << 64) for k in range(max_n + 1)]  # _HASH_MUL^k mod 2^64
        self._last: tuple[int, int, list[int]] | None = None  # (tokens then, k, proposal): `propose`'s last answer

    def append(self, tokens) -> None:
        """Add tokens without registering their n-grams (`register` does; `propose` reads them meanwhile)."""
        self.tokens.extend(map(int, tokens))

    def extend(self, tokens) -> None:
        """Add tokens and register every n-gram not yet registered."""
        self.append(tokens)
        self.register()

    def register(self) -> None:
        old, toks = self.indexed, self.tokens
        self.indexed = len(toks)
        if len(toks) - old >= _BULK:
            self._index_bulk(old)
            return
        # The n-grams ending at L now have a next token: tokens[L]. `_ngram_key` of the n tokens before L is
        # n·M^n + Σ_j tokens[L−1−j]·M^j (mod 2^64): one pass backwards from L gives every n's key, each from the
        # last (a step's few new tokens: this loop is the drafter's host time per row and step).
        pw, end, lo, hi = self._pow, self._end, self.min_n, self.max_n
        for L in range(old, len(toks)):
            acc = 0
            for n in range(1, min(hi, L) + 1):
                acc = (acc + toks[L - n] * pw[n - 1]) & _MASK
                if n >= lo:
                    end[(n * pw[n] + acc) & _MASK] = L

    def _index_bulk(self, old: int) -> None:
        """Register the n-grams ending at every L in [old, len) — as `register`'s loop does, vectorized: for each
        n the keys of all windows at once (uint64 arithmetic wraps modulo 2^64, as `_ngram_key` masks), then
        one dict update in order (a later occurrence overwrites an earlier one: the most recent wins)."""
        base = max(old - self.max_n, 0)
        arr = np.asarray(self.tokens[base:], dtype=np.uint64)
        mul = np.uint64(_HASH_MUL)
        for n in range(self.min_n, self.max_n + 1):
            first = max(old, n)  # the first L registered for this n
            count = len(self.tokens) - first
            if count <= 0:
                continue
            start = first - n - base  # arr index of the window ending at `first`
            h = np.full(count, n, dtype=np.uint64)
            for j in range(n):
                h = h * mul + arr[start + j : start + j + count]
            self._end.update(zip(h.tolist(), range(first, first + count)))

    @staticmethod
    def extend_many(pairs: list[tuple["NgramIndex", list[int]]]) -> None:
        """`extend` each index by its few new tokens (`register_many`)."""
        for ix, new in pairs:
            ix.append(new)
        NgramIndex.register_many([ix for ix, _ in pairs])

    @staticmethod
    def register_many(indexes: list["NgramIndex"]) -> None:
        """`register` each index, the n-grams' keys computed for all of them at once — a decoding step's growth
        over a batch (64 rows × ~10 tokens: ~0.7 ms of per-token Python in `register`, an H100 burst's largest
        planning cost). The same entries as registering one by one: per index, keys in order of their end (the
        most recent occurrence wins). Indexes of other n-gram sizes, or behind by `_BULK` tokens or more,
        register alone."""
        batch = [ix for ix in indexes if ix.indexed < len(ix.tokens)]
        if not batch:
            return
        lo, hi = batch[0].min_n, batch[0].max_n
        if len(batch) == 1 or any(
            ix.min_n != lo or ix.max_n != hi or len(ix.tokens) - ix.indexed >= _BULK for ix in batch
        ):
            for ix in batch:
                ix.register()
            return
        # All indexes' tails in one flat array: for index i, its tokens from max(old_i − hi, 0) (the hi before its
        # first unregistered position) to its end. Each new position L has a flat position g; each n's key is
        # n·M^n + Σ_{j<n} flat[g − 1 − j]·M^j (uint64 arithmetic wraps as `_ngram_key` masks). A position with fewer
        # than n tokens before it in its index reads its neighbour's tail: such (L, n) are skipped below.
        flat: list[int] = []
        at_new: list[int] = []  # flat position of every new position, index by index
        firsts, counts = [], []  # per index: its first new position, how many
        for ix in batch:
            old, end = ix.indexed, len(ix.tokens)
            start = max(old - hi, 0)
            base = len(flat) - start
            flat += ix.tokens[start:]
            at_new += range(base + old, base + end)
            firsts.append(old)
            counts.append(end - old)
            ix.indexed = end
        arr = np.asarray(flat, dtype=np.uint64)
        g = np.asarray(at_new, dtype=np.int64)
        # each new position's L (its end: where the n-grams before it end) within its own index
        ends = np.repeat(np.asarray(firsts, dtype=np.int64), counts) + (
            np.arange(len(g)) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        pw = batch[0]._pow  # M^k mod 2^64, Python ints
        acc = np.zeros(len(g), dtype=np.uint64)
        keys = np.empty((len(g), hi - lo + 1), dtype=np.uint64)  # [position, n − lo]
        for n in range(1, hi + 1):
            acc = acc + arr[g - n] * np.uint64(pw[n - 1])
            if n >= lo:
                keys[:, n - lo] = acc + np.uint64(n * pw[n] & _MASK)
        # (L, n) with n tokens before L, position by position: per index one run, its positions in order — within
        # each n the most recent occurrence still comes last (keys of different n never coincide: n is hashed in)
        valid = ends[:, None] >= np.arange(lo, hi + 1)[None, :]
        key_list = keys[valid].tolist()
        end_list = np.broadcast_to(ends[:, None], valid.shape)[valid].tolist()
        bounds = np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).tolist()
        at = 0
        for ix, count in zip(batch, counts):
            a, b = bounds[at], bounds[at + count]
            ix._end.update(zip(key_list[a:b], end_list[a:b]))
            at += count

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the tokens so far, from the longest suffix seen before ([] if none)."""
        L = len(self.tokens)
        last = self._last
        if last is not None and last[0] == L and k <= last[1]:
            # (a step asks twice: the policy's shadow scorer at the family's depth, then `prepare` at the plan's γ —
            # the same match, so the same tokens up to k)
            return last[2][:k]
        out = self._propose(k, L)
        self._last = (L, k, out)
        return list(out)

    def _propose(self, k: int, L: int) -> list[int]:
        toks = self.tokens
        if L - self.indexed > _TAIL:  # (a tail left unregistered this long: registering is cheaper than scanning)
            self.register()
        last = toks[L - 1] if L else None
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            suffix = toks[L - n :]
            # the newest occurrence: in the unregistered tail (ends L − 1 … indexed, newest first), else registered
            end = None
            for e in range(L - 1, max(self.indexed, n) - 1, -1):
                if toks[e - 1] == last and toks[e - n : e] == suffix:
                    end = e
                    break
            if end is None:
                end = self._end.get(_ngram_key(suffix))
            if end is not None and toks[end - n : end] == suffix:
                out = toks[end : end + k]
                while len(out) < k:  # (past the end: the proposal continues itself — a period of L − end)
                    out.append(out[len(out) - (L - end)])
                return out
        return []


class DraftlessDrafter(Drafter):
    """What every draftless drafter shares: a host-side index per row (`_new_index`, grown from the row's
    history before each step), proposals written into a device buffer by `prepare` and read by `propose`
    (no host work inside a step, so a captured CUDA graph replays it), and deterministic children.

    Deterministic children (`deterministic_children`): a proposal is a function of the row's tokens, not a
    draw. A chain's one-hot draft distribution makes rejection sampling exact; a node with several
    children has no distribution they were drawn from, so only the verifiers that accept the child equal
    to the target's own pick (greedy; topk / match: y ~ p) verify a tree (`engine.decode.resolve_verifier`)."""

    needs_history = True
    deterministic_children = True

    def __init__(self, vocab_size: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N):
        super().__init__(FullPolicy())
        check_ngram_sizes(min_n, max_n)
        self.vocab_size, self.min_n, self.max_n = vocab_size, min_n, max_n
        self._rows: dict[int, object] = {}  # slot → the row's index
        # drafts per step → [rows, drafts] proposals, read by (captured) steps: one buffer per size, so a policy
        # switching γ between steps reuses each one's CUDA graphs instead of reallocating (and capturing) at
        # every switch
        self._buffers: dict[int, torch.Tensor] = {}
        self._buffer: torch.Tensor | None = None  # the current step's
        self.proposed = 0  # steps × rows with a proposal, and without (stats for reports)
        self.unmatched = 0

    # ------------------------------------------------------------------ a subclass's part
    def _new_index(self):
        raise NotImplementedError

    def _draft_row(self, index, tree: Tree) -> tuple[list[int], bool]:
        """The row's draft tokens for nodes 1 … n − 1 of `tree` (padded where nothing is known), and
        whether its index matched at all."""
        raise NotImplementedError

    def _retire(self, index) -> None:
        """A row's index is dropped (its request left the slot)."""

    # ------------------------------------------------------------------ the Drafter interface
    def reset_row(self, slot: int) -> None:
        index = self._rows.pop(slot, None)
        if index is not None:
            self._retire(index)

    def index_prefix(self, slot: int, token_ids: list[int], stop: int) -> None:
        """Grow the row's index over `token_ids[:stop]` — its prompt as far as prefilled. The executor calls this
        with each prefill chunk, after launching the chunk's forwards (on a GPU they run meanwhile): a 30K-token
        prompt is ~10 ms of host indexing, and left to the first decoding step, a burst of 64 such rows held
        that step ~1 s (an H100, session 35); run after a prefill that had waited for its forwards, it
        lengthened the prefill as much (session 36)."""
        self._index(slot, token_ids, stop)

    def _index(self, slot: int, history: list[int], stop: int | None = None):
        """The row's index, grown to `history[:stop]` (default: all of it; a new one when the slot's tokens are
        not its continuation)."""
        stop = len(history) if stop is None else stop
        index = self._row_index(slot, stop)
        self._grow_index(index, history[len(index.tokens) : stop])
        return index

    def _grow_index(self, index, new: list[int]) -> None:
        """Add a row's new tokens to its index."""
        index.extend(new)

    def _row_index(self, slot: int, stop: int):
        """The slot's index as it is, or a new one when it holds more than `stop` tokens (a new request there)."""
        index = self._rows.get(slot)
        if index is None or len(index.tokens) > stop:
            self.reset_row(slot)
            index = self._rows[slot] = self._new_index()
        return index

    def grow(self, rows: list[tuple[int, list[int]]]) -> None:
        """Grow each (slot, history)'s index to the history's end (a step's rows at once where the index allows)."""
        for slot, history in rows:
            self._index(slot, history)

    def prepare(self, rows: list[tuple[int, list[int]]], tree: Tree, n: int, device: torch.device) -> bool:
        """Index each row's new tokens and write its proposal into the buffer's first n rows; → whether
        any row matched (else the step runs plainly)."""
        self.grow(rows)
        size = tree.size - 1
        table = torch.zeros(n, size, dtype=torch.long)
        any_match = False
        slots, drafted = [], []
        for slot, history in rows:
            drafts, matched = self._draft_row(self._index(slot, history), tree)
            any_match |= matched
            self.proposed += matched
            self.unmatched += not matched
            slots.append(slot)
            drafted.append(drafts)
        if slots and size:
            table[slots] = torch.tensor(drafted, dtype=torch.long)  # (one tensor for the rows: not one each)
        buffer = self._buffers.get(size)
        if buffer is None or buffer.shape[0] < n:
            buffer = self._buffers[size] = torch.zeros(max(n, 1), size, dtype=torch.long, device=device)
        buffer[:n].copy_(table.to(device), non_blocking=True)
        self._buffer = buffer
        return any_match

    def propose(self, target, draft, prev, last, tree, sampler, rule, need_q):
        B = last.shape[0]
        tokens = torch.cat([last[:, None], self._buffer[:B, : tree.size - 1]], dim=1)  # [B, n]
        if not need_q:
            return tokens, None
        if not tree.is_chain:  # (resolve_verifier refuses this combination before any step)
            raise ConfigError(
                "deterministic draft children have no draft distribution: verify a tree with greedy / topk / match"
            )
        # one-hot draft distributions: node i's child is tokens[:, i + 1]; the leaf has none (zeros)
        q = F.one_hot(tokens[:, 1:], self.vocab_size).float()  # [B, n − 1, V]
        return tokens, torch.cat([q, q.new_zeros(B, 1, self.vocab_size)], dim=1)

    def graph_key(self) -> tuple:
        # (a captured step reads the buffer: a new buffer needs a new capture)
        return (*super().graph_key(), None if self._buffer is None else self._buffer.data_ptr())


class NgramDrafter(DraftlessDrafter):
    """Prompt lookup over each row's prompt and output (a chain: one proposal per row)."""

    family = "ngram"

    def describe(self) -> str:
        return f"ngram {self.min_n}-{self.max_n}"

    # Whether a step's tokens are appended to the rows' indexes and registered later (`register_pending`, called
    # by the automatic policy in the job the device's step covers) instead of at once; `propose` answers the same.
    lazy = False

    def _new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def _grow_index(self, index: NgramIndex, new: list[int]) -> None:
        if self.lazy:
            index.append(new)
        else:
            index.extend(new)

    def index_prefix(self, slot: int, token_ids: list[int], stop: int) -> None:
        self._index(slot, token_ids, stop).register()  # (a prompt chunk: registered now, while the device works)

    def shadow_propose(self, slot: int, history: list[int], k: int) -> list[int]:
        """What a step would propose after `history` (up to k tokens; [] without a match), for scoring."""
        return self._index(slot, history).propose(k)

    def grow(self, rows: list[tuple[int, list[int]]]) -> None:
        indexes = [(self._row_index(slot, len(history)), history) for slot, history in rows]
        if self.lazy:
            for index, history in indexes:
                self._grow_index(index, history[len(index.tokens) :])
        else:
            NgramIndex.extend_many([(index, history[len(index.tokens) :]) for index, history in indexes])

    def register_pending(self, slots) -> None:
        """Register what the rows in `slots` appended (`lazy`), their indexes at once."""
        NgramIndex.register_many([self._rows[s] for s in slots if s in self._rows])

    def _draft_row(self, index: NgramIndex, tree: Tree) -> tuple[list[int], bool]:
        if not tree.is_chain:
            raise ConfigError("the ngram drafter proposes a chain; use num_draft_tokens (γ), not a tree")
        gamma = tree.size - 1
        proposal = index.propose(gamma)  # (no match: the newest token repeated, rarely accepted)
        return proposal + [index.tokens[-1]] * (gamma - len(proposal)), bool(proposal)
