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
just before it, so a lookup costs `max_n − min_n + 1` dictionary probes, whatever the context length.
"""

from __future__ import annotations

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


class NgramIndex:
    """One row's tokens and, for each n-gram of min_n..max_n tokens that has a token after it, where its
    most recent such occurrence ends (exclusive)."""

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N):
        check_ngram_sizes(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._end: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        for t in tokens:
            L = len(self.tokens)  # the n-grams ending here now have a next token: t
            for n in range(self.min_n, min(self.max_n, L) + 1):
                self._end[tuple(self.tokens[L - n :])] = L
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the tokens so far, from the longest suffix seen before ([] if none)."""
        L = len(self.tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            end = self._end.get(tuple(self.tokens[L - n :]))
            if end is not None:
                out: list[int] = []
                for j in range(k):  # tokens[end:], continued by the proposal itself past the end (a period)
                    i = end + j
                    out.append(self.tokens[i] if i < L else out[i - L])
                return out
        return []


class NgramDrafter(Drafter):
    """Prompt lookup over each row's prompt and output (a chain: one proposal per row)."""

    needs_history = True
    family = "ngram"

    def __init__(self, vocab_size: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N):
        super().__init__(FullPolicy())
        check_ngram_sizes(min_n, max_n)
        self.vocab_size, self.min_n, self.max_n = vocab_size, min_n, max_n
        self._rows: dict[int, NgramIndex] = {}
        # γ → [rows, γ] proposals, read by (captured) steps: one buffer per γ, so a policy switching γ between
        # steps reuses each one's CUDA graphs instead of reallocating (and capturing) at every switch
        self._buffers: dict[int, torch.Tensor] = {}
        self._buffer: torch.Tensor | None = None  # the current step's
        self.proposed = 0  # steps × rows with a proposal, and without (stats for reports)
        self.unmatched = 0

    def describe(self) -> str:
        return f"ngram {self.min_n}-{self.max_n}"

    def reset_row(self, slot: int) -> None:
        self._rows.pop(slot, None)

    def _index(self, slot: int, history: list[int]) -> NgramIndex:
        """The row's index, grown to `history` (a new one when the slot's tokens are not its continuation)."""
        index = self._rows.get(slot)
        if index is None or len(index.tokens) > len(history):
            index = self._rows[slot] = NgramIndex(self.min_n, self.max_n)
        index.extend(history[len(index.tokens) :])
        return index

    def shadow_propose(self, slot: int, history: list[int], k: int) -> list[int]:
        """What a step would propose after `history` (up to k tokens; [] without a match), for scoring."""
        return self._index(slot, history).propose(k)

    def prepare(self, rows: list[tuple[int, list[int]]], tree: Tree, n: int, device: torch.device) -> bool:
        """Index each row's new tokens and write its proposal (padded with its newest token) into the
        proposal buffer's first n rows; → whether any row proposed (else the step runs plainly)."""
        if not tree.is_chain:
            raise ConfigError("the ngram drafter proposes a chain; use num_draft_tokens (γ), not a tree")
        gamma = tree.size - 1
        table = torch.zeros(n, gamma, dtype=torch.long)
        any_match = False
        for slot, history in rows:
            proposal = self._index(slot, history).propose(gamma)
            if proposal:
                any_match = True
                self.proposed += 1
            else:
                self.unmatched += 1
            proposal += [history[-1]] * (gamma - len(proposal))
            table[slot] = torch.tensor(proposal)
        buffer = self._buffers.get(gamma)
        if buffer is None or buffer.shape[0] < n:
            buffer = self._buffers[gamma] = torch.zeros(max(n, 1), gamma, dtype=torch.long, device=device)
        buffer[:n].copy_(table.to(device), non_blocking=True)
        self._buffer = buffer
        return any_match

    def propose(self, target, draft, prev, last, tree, sampler, rule, need_q):
        B = last.shape[0]
        tokens = torch.cat([last[:, None], self._buffer[:B, : tree.size - 1]], dim=1)  # [B, n]
        if not need_q:
            return tokens, None
        # one-hot draft distributions: node i's child is tokens[:, i + 1]; the leaf has none (zeros)
        q = F.one_hot(tokens[:, 1:], self.vocab_size).float()  # [B, n − 1, V]
        return tokens, torch.cat([q, q.new_zeros(B, 1, self.vocab_size)], dim=1)

    def graph_key(self) -> tuple:
        # (a captured step reads the buffer: a new buffer needs a new capture)
        return (*super().graph_key(), None if self._buffer is None else self._buffer.data_ptr())
