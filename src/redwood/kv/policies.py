"""Draft KV policies: which committed tokens a drafter's attention reads.

A policy never copies or moves KV: it turns per-row committed lengths into a *context view* — for each
layer, slot indices [B, H', C] into the cache and a validity mask — that the attention gathers through.
Keys keep the true rotary positions they were written with. In self-speculation the view is over the
target's own cache, so the draft costs no memory and every committed token's KV is the target's exact
KV; a standalone draft model reads its own cache through the same views.

- `full`: the whole context (no view).
- `streaming` (StreamingLLM): the first `sinks` tokens plus the `window` most recent committed tokens.
  Evicts as it goes — C = sinks + window whatever the length, so drafting cost stays constant.
- `snapkv`: at prefill, the last `window` prompt tokens (the observation window) score every earlier
  prompt position by their attention (softmax in float32, summed over the window queries), smoothed by
  pooling along the sequence (`kernel`, avg or max) and summed over the query heads of each KV group;
  each layer and KV head keeps its top `budget − window` positions. Decoding rule: the draft reads the
  selected positions plus the most recent `budget − selected` tokens from the observation window on —
  at prefill that is exactly the observation window, and as tokens are generated the recent part slides
  forward, so the draft never reads more than `budget` tokens. A budget ≥ the prompt keeps everything
  (the full cache) until generation outgrows it.

SnapKV scores the prefill through a `PrefillObserver`. The prefill runs in chunks (bounded attention
work at 32K-token contexts); a window query at position p attends to keys [0, p], all of which are in
the cache when p's chunk runs. So the observer watches only the forwards holding some row's window
queries (the others take the fast attention path), adds each window query's attention (its softmax over
keys [0, p]) to per-layer votes as they go, and selects once the forward reaching the longest prompt's
end is done — the same selection as one forward over the whole prompt, up to float summation order.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from redwood.attention.reference import ContextView, Observer, SpanView
from redwood.errors import ConfigError

KV_POLICIES = ("full", "streaming", "snapkv")

# SnapKV's window scores of one forward are computed for this many rows at a time, so that its
# [rows, Hq, window, S] float32 attention stays about this many elements (1 GiB) at long contexts.
OBSERVE_SCORE_BUDGET = 1 << 28


class PrefillObserver(Protocol):
    """Watches a prefill's attention, chunk by chunk (SnapKV's observation window).

    A prefill (`redwood.engine.prefill`) runs its forwards over positions [a, b) in order and, for each
    forward where `observes(a, b)`, passes `at(a)` as that forward's observer; after the last forward
    `finish()` is called.
    """

    def observes(self, start: int, stop: int) -> bool:
        """Whether some row's queries at positions [start, stop) are watched."""
        ...

    def at(self, start: int) -> Observer:
        """The observer of a forward whose first query position is `start`."""
        ...

    def finish(self) -> None:
        """The prefill is done: its result is complete."""
        ...


class DraftKVPolicy:
    """Base: the full context."""

    name = "full"
    # `admit` gives each row's prefill an observer (SnapKV): the Engine runs such a row's prefill chunks alone
    observes_prefill = False
    # Bumped whenever the policy reallocates the buffers its views read: a captured draft step is keyed
    # by it, so a graph never reads a stale buffer.
    version = 0

    def start(self, prompt_lengths: torch.Tensor, num_layers: int) -> None:
        """Called once per generation before the prefill that the policy observes."""

    def prefill_observer(self) -> PrefillObserver | None:
        """An observer for the prefill whose attention the policy scores (SnapKV), else None."""
        return None

    def view(self, lengths: torch.Tensor) -> ContextView | None:
        """The context view for a draft forward given committed lengths [B]; None = full context."""
        return None

    # Per-row use (the Engine: rows are batch slots that requests join and leave).
    def allocate(self, num_rows: int, num_layers: int, num_kv_heads: int, device: torch.device) -> None:
        """Hold per-row state for `num_rows` slots (views over rows [0, n) read its first n rows)."""

    def admit(self, row: int, prompt_length: int) -> PrefillObserver | None:
        """A request whose prefill covers `prompt_length` tokens takes slot `row`: the observer its
        prefill must run with (its result lands in row `row`), or None."""
        return None

    def prefix_limit(self, prompt_length: int) -> int:
        """How many leading prompt tokens may come from a prefix cache instead of being computed (SnapKV
        must see its observation window's queries attend, so those are always computed)."""
        return prompt_length

    def describe(self) -> str:
        return self.name

    def reads(self) -> int | None:
        """The most context slots a draft forward reads through this policy (None: the whole context)."""
        return None


class FullPolicy(DraftKVPolicy):
    name = "full"


class StreamingPolicy(DraftKVPolicy):
    name = "streaming"

    def __init__(self, sinks: int, window: int):
        if sinks < 0 or window < 1:
            raise ConfigError(
                f"streaming draft KV needs sinks >= 0 and window >= 1, got sinks={sinks}, window={window}"
            )
        self.sinks, self.window = sinks, window

    def indices(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx, valid: [B, sinks + window] — sink slots then the last `window` committed slots."""
        return self.view(lengths).indices()

    def view(self, lengths: torch.Tensor) -> SpanView:
        return SpanView(lengths, self.sinks, self.window)  # (the Triton kernel reads its two ranges directly)

    def describe(self) -> str:
        return f"streaming(sinks={self.sinks}, window={self.window})"

    def reads(self) -> int:
        return self.sinks + self.window


class SnapKVPolicy(DraftKVPolicy):
    """SnapKV (see the module docstring); it is its own `PrefillObserver`."""

    name = "snapkv"
    observes_prefill = True

    def __init__(self, budget: int, window: int = 32, kernel: int = 5, pool: str = "avg"):
        if budget < 1 or window < 1:
            raise ConfigError(
                f"snapkv draft KV needs budget >= 1 and window >= 1, got budget={budget}, window={window}"
            )
        if budget < window:
            raise ConfigError(
                f"snapkv draft KV keeps the whole observation window, so it needs budget >= window; "
                f"got budget={budget}, window={window} (pass a smaller --window)"
            )
        if kernel < 1 or kernel % 2 == 0:
            raise ConfigError(f"snapkv pooling kernel must be odd and >= 1, got {kernel}")
        if pool not in ("avg", "max"):
            raise ConfigError(f"snapkv pooling must be 'avg' or 'max', got {pool!r}")
        self.budget, self.window, self.kernel, self.pool = budget, window, kernel, pool
        self.selected: list[torch.Tensor | None] = []  # per layer: [B, Hkv, K] slot indices
        self.selected_valid: list[torch.Tensor | None] = []  # per layer: [B, Hkv, K]
        self.obs_start: torch.Tensor | None = None  # [B] first slot of each row's observation window
        self.prompt_lengths: torch.Tensor | None = None  # [B]
        self._observed: list[bool] = []  # per layer: its selection is this generation's
        self._lengths: list[int] = []  # prompt lengths on the host (which prefill chunks are watched)
        # Per layer, while a chunked prefill is observed: [B, Hkv, G, T] float32 window votes so far.
        self._votes: list[torch.Tensor | None] = []

    def start(self, prompt_lengths: torch.Tensor, num_layers: int) -> None:
        # The selection lives in buffers that are reused (filled in place) while the batch shape stays
        # the same, so a draft step captured in a CUDA graph reads the current generation's selection.
        if (
            self.prompt_lengths is None
            or self.prompt_lengths.shape != prompt_lengths.shape
            or self.prompt_lengths.device != prompt_lengths.device
            or len(self.selected) != num_layers
        ):
            self.version += 1
            self.prompt_lengths = torch.zeros_like(prompt_lengths)
            self.obs_start = torch.zeros_like(prompt_lengths)
            self.selected = [None] * num_layers
            self.selected_valid = [None] * num_layers
        self.prompt_lengths.copy_(prompt_lengths)
        self.obs_start.copy_((prompt_lengths - self.window).clamp(min=0))
        self._observed = [False] * num_layers
        self._votes = [None] * num_layers
        self._lengths = prompt_lengths.tolist()  # (one host sync per generation)

    # ------------------------------------------------------------------ observing the prefill
    def prefill_observer(self) -> PrefillObserver:
        return self

    def observes(self, start: int, stop: int) -> bool:
        # row b's window: positions [max(len_b − window, 0), len_b)
        return any(max(n - self.window, 0) < stop and start < n for n in self._lengths)

    def at(self, start: int) -> Observer:
        return partial(self.observe, q_start=start)

    def finish(self) -> None:
        if not all(self._observed):
            missing = [i for i, done in enumerate(self._observed) if not done]
            raise RuntimeError(
                f"snapkv: the prefill ended before layers {missing} saw every observation-window "
                f"query (were its prompts the ones given to start()?)"
            )

    def observe(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, q_start: int = 0
    ) -> None:
        """Add one forward's observation-window attention at `layer` (the forward observer).

        q: [B, Hq, T, D] the queries of positions [q_start, q_start + T); k: [B, Hkv, S, D] the keys of
        cache slots [0, S), S ≥ q_start + T. The forward that reaches the longest prompt's end (the
        prefill's last chunk) has seen every window query: the layer's selection is made there and its
        votes are freed. (One forward over the whole prompt: q_start 0, T the longest prompt.)
        """
        assert self.obs_start is not None and q.shape[0] == len(self._lengths), "snapkv: start() first"
        total = max(self._lengths)
        votes = self.window_votes(q, k, q_start)[..., :total]  # [B, Hkv, G, ≤ total]
        acc = self._votes[layer]
        if acc is None and votes.shape[-1] == total:
            acc = votes
        else:
            if acc is None:
                acc = votes.new_zeros(*votes.shape[:3], total)
            acc[..., : votes.shape[-1]] += votes
        if q_start + q.shape[2] >= total:
            self._votes[layer] = None
            self._select(layer, acc)
        else:
            self._votes[layer] = acc

    def window_votes(self, q: torch.Tensor, k: torch.Tensor, q_start: int = 0) -> torch.Tensor:
        """Attention of the observation-window queries among q to each key: [B, Hkv, G, S] float32.

        q: [B, Hq, T, D] queries of positions [q_start, q_start + T) (row b's window: the last `window`
        positions of its prompt, [len_b − window, len_b)); k: [B, Hkv, S, D] keys of slots [0, S). Each
        window query in q contributes its float32 softmax over keys [0, its position], summed per query
        head (G = Hq / Hkv per KV head); window queries outside q contribute nothing.
        """
        B, Hq, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = Hq // Hkv
        dev = q.device
        votes = torch.zeros(B, Hkv, G, S, dtype=torch.float32, device=dev)
        span = self._window_span(q_start, T)
        if span is None:
            return votes
        # Query positions of the window entries [j0, j1) that some row has in q (entry j of row b is
        # position len_b − window + j: the window is right-aligned at each row's last prompt token).
        j0, j1 = span
        w = j1 - j0
        qpos = self.prompt_lengths[:, None] - self.window + torch.arange(j0, j1, device=dev)  # [B, w]
        here = (qpos >= 0) & (qpos >= q_start) & (qpos < q_start + T)  # [B, w] window queries in this q
        qsel = torch.gather(q, 2, (qpos - q_start).clamp(0, T - 1)[:, None, :, None].expand(B, Hq, w, D))
        qsel = qsel.float().view(B, Hkv, G * w, D)
        kpos = torch.arange(S, device=dev)
        causal = kpos[None, None, :] <= qpos[:, :, None]  # [B, w, S]
        rows = max(1, OBSERVE_SCORE_BUDGET // (Hq * w * S))
        for r0 in range(0, B, rows):
            r = slice(r0, r0 + rows)
            logits = qsel[r] @ k[r].float().transpose(-1, -2) / D**0.5  # [rows, Hkv, G*w, S]
            logits = logits.view(-1, Hkv, G, w, S).masked_fill(~causal[r, None, None], float("-inf"))
            attn = logits.softmax(-1).nan_to_num(0.0) * here[r, None, None, :, None]
            votes[r] = attn.sum(dim=3)  # summed over the window queries, per query head
        return votes

    def _window_span(self, q_start: int, T: int) -> tuple[int, int] | None:
        """Window entries [j0, j1) (of 0…window−1) that some row has among positions [q_start, q_start + T);
        None if no row has any. (A forward of a few tokens computes only those, not the whole window.)"""
        spans = [
            (
                min(max(q_start - n + self.window, 0), self.window),
                min(max(q_start + T - n + self.window, 0), self.window),
            )
            for n in self._lengths
        ]
        spans = [(a, b) for a, b in spans if a < b]
        if not spans:
            return None
        return min(a for a, _ in spans), max(b for _, b in spans)

    def scores(self, votes: torch.Tensor) -> torch.Tensor:
        """Pooled, group-summed window votes [B, Hkv, G, S] → each prefix slot's score [B, Hkv, S].

        Slots outside a row's prefix [0, obs_start) score -inf.
        """
        B, Hkv, G, S = votes.shape
        kpos = torch.arange(S, device=votes.device)
        prefix = kpos[None, :] < self.obs_start[:, None]  # [B, S]
        votes = votes * prefix[:, None, None]
        if self.kernel > 1:
            # Pool each query head's votes, then sum the group (the order matters for max pooling). Outside
            # the prefix a vote is 0 and counts as 0 (SnapKV's zero padding), so a row's scores do not
            # depend on how far the batch pads it.
            flat = votes.reshape(B * Hkv * G, 1, S)
            pad = self.kernel // 2
            if self.pool == "avg":
                flat = F.avg_pool1d(flat, self.kernel, stride=1, padding=pad, count_include_pad=True)
            else:
                flat = F.max_pool1d(flat, self.kernel, stride=1, padding=pad)
            votes = flat.view(B, Hkv, G, S)
        votes = votes.sum(dim=2)  # [B, Hkv, S] — summed over the query heads of each KV group
        return votes.masked_fill(~prefix[:, None], float("-inf"))

    def _select(self, layer: int, votes: torch.Tensor) -> None:
        """Keep each KV head's top (budget − window) prefix slots, given its window votes [B, Hkv, G, S]."""
        votes = self.scores(votes)  # [B, Hkv, S]
        K = self.budget - self.window  # always K entries (invalid past the prefix), a static view width
        top = votes.topk(min(K, votes.shape[-1]), dim=-1)
        idx = torch.zeros(*votes.shape[:2], K, dtype=torch.long, device=votes.device)
        valid = torch.zeros(*votes.shape[:2], K, dtype=torch.bool, device=votes.device)
        idx[..., : top.indices.shape[-1]] = top.indices
        valid[..., : top.indices.shape[-1]] = top.values > float("-inf")
        if self.selected[layer] is None or self.selected[layer].shape != idx.shape:
            self.version += 1
            self.selected[layer], self.selected_valid[layer] = idx, valid
        else:
            self.selected[layer].copy_(idx)
            self.selected_valid[layer].copy_(valid)
        self._observed[layer] = True

    # ------------------------------------------------------------------ per-row use (the Engine)
    def allocate(self, num_rows: int, num_layers: int, num_kv_heads: int, device: torch.device) -> None:
        self.version += 1
        K = self.budget - self.window
        self.prompt_lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.obs_start = torch.zeros(num_rows, dtype=torch.long, device=device)
        shape = (num_rows, num_kv_heads, K)
        self.selected = [torch.zeros(shape, dtype=torch.long, device=device) for _ in range(num_layers)]
        self.selected_valid = [torch.zeros(shape, dtype=torch.bool, device=device) for _ in range(num_layers)]
        self._observed = [True] * num_layers

    def admit(self, row: int, prompt_length: int) -> PrefillObserver:
        # One row's prefill is observed by a one-row SnapKV of the same settings, whose selection is
        # copied into row `row` when the prefill ends (_RowObserver.finish).
        one = SnapKVPolicy(self.budget, self.window, self.kernel, self.pool)
        dev = self.obs_start.device
        one.start(torch.tensor([prompt_length], device=dev), len(self.selected))
        self.prompt_lengths[row] = prompt_length
        self.obs_start[row] = max(prompt_length - self.window, 0)
        return _RowObserver(one, self, row)

    def prefix_limit(self, prompt_length: int) -> int:
        return max(prompt_length - self.window, 0)

    def _take_row(self, row: int, one: "SnapKVPolicy") -> None:
        for layer, (idx, valid) in enumerate(zip(one.selected, one.selected_valid)):
            self.selected[layer][row] = idx[0]
            self.selected_valid[layer][row] = valid[0]

    def view(self, lengths: torch.Tensor) -> ContextView:
        assert self.obs_start is not None and all(self._observed), "snapkv: no prefill seen"
        dev = lengths.device
        n = lengths.shape[0]  # a view over rows [0, n) of the policy's rows
        sel = torch.stack([s[:n] for s in self.selected])  # [L, B, Hkv, K]
        sel_valid = torch.stack([s[:n] for s in self.selected_valid])
        n_sel = sel_valid.sum(-1)  # [L, B, Hkv]
        recent_n = self.budget - n_sel  # [L, B, Hkv] slots left for the recent part
        R = self.budget  # ≥ every recent_n: a static width (no host sync); extra entries are invalid
        recent = lengths[:, None] - R + torch.arange(R, device=dev)  # [B, R]
        lo = torch.maximum(lengths[None, :, None] - recent_n, self.obs_start[None, :n, None])  # [L, B, Hkv]
        recent_valid = recent[None, :, None, :] >= lo[..., None]
        recent = recent.clamp(min=0)[None, :, None, :].expand_as(recent_valid)
        idx = torch.cat([sel, recent], dim=-1)
        valid = torch.cat([sel_valid, recent_valid], dim=-1)
        return lambda layer: (idx[layer], valid[layer])

    def reads(self) -> int:
        return self.budget

    def describe(self) -> str:
        return f"snapkv(budget={self.budget}, window={self.window}, kernel={self.kernel}, pool={self.pool})"


class _RowObserver:
    """The PrefillObserver of one row's prefill (`SnapKVPolicy.admit`): a one-row SnapKV observes it;
    at `finish` its selection moves into the slot's row of the per-row policy."""

    def __init__(self, one: SnapKVPolicy, owner: SnapKVPolicy, row: int):
        self.one, self.owner, self.row = one, owner, row

    def observes(self, start: int, stop: int) -> bool:
        return self.one.observes(start, stop)

    def at(self, start: int) -> Observer:
        return self.one.at(start)

    def finish(self) -> None:
        self.one.finish()
        self.owner._take_row(self.row, self.one)


def make_policy(
    name: str,
    budget: int | None = None,
    sinks: int | None = None,
    window: int | None = None,
    kernel: int = 5,
    pool: str = "avg",
) -> DraftKVPolicy:
    """Build a policy from CLI/API settings.

    streaming: `sinks` (default 4) + `window`; given a budget, window defaults to budget − sinks.
    snapkv: `budget` (required) and observation `window` (default 32).
    """
    if name == "full":
        return FullPolicy()
    if name == "streaming":
        sinks = 4 if sinks is None else sinks
        if window is None:
            if budget is None:
                raise ConfigError("streaming draft KV needs --draft-budget or --window")
            window = budget - sinks
        elif budget is not None and budget != sinks + window:
            raise ConfigError(f"streaming: --draft-budget {budget} != sinks {sinks} + window {window}")
        return StreamingPolicy(sinks, window)
    if name == "snapkv":
        if budget is None:
            raise ConfigError("snapkv draft KV needs --draft-budget")
        return SnapKVPolicy(budget, 32 if window is None else window, kernel, pool)
    raise ConfigError(f"unknown draft KV policy {name!r}; choose one of {', '.join(KV_POLICIES)}")
