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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from redwood.attention.reference import ContextView, Observer
from redwood.errors import ConfigError

KV_POLICIES = ("full", "streaming", "snapkv")


class DraftKVPolicy:
    """Base: the full context."""

    name = "full"
    # Bumped whenever the policy reallocates the buffers its views read: a captured draft step is keyed
    # by it, so a graph never reads a stale buffer.
    version = 0

    def start(self, prompt_lengths: torch.Tensor, num_layers: int) -> None:
        """Called once per generation before the prefill that the policy observes."""

    def prefill_observer(self) -> Observer | None:
        """An observer for the prefill forward whose attention the policy scores (SnapKV), else None."""
        return None

    def view(self, lengths: torch.Tensor) -> ContextView | None:
        """The context view for a draft forward given committed lengths [B]; None = full context."""
        return None

    def describe(self) -> str:
        return self.name


class FullPolicy(DraftKVPolicy):
    name = "full"


class StreamingPolicy(DraftKVPolicy):
    name = "streaming"

    def __init__(self, sinks: int, window: int):
        if sinks < 0 or window < 1:
            raise ConfigError(f"streaming draft KV needs sinks >= 0 and window >= 1, got sinks={sinks}, window={window}")
        self.sinks, self.window = sinks, window

    def indices(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx, valid: [B, sinks + window] — sink slots then the last `window` committed slots."""
        dev = lengths.device
        B = lengths.shape[0]
        sink = torch.arange(self.sinks, device=dev)[None].expand(B, -1)
        recent = lengths[:, None] - self.window + torch.arange(self.window, device=dev)
        idx = torch.cat([sink, recent], dim=1)
        # A recent slot below `sinks` is already a sink (short context); slots < 0 don't exist.
        valid = torch.cat([sink < lengths[:, None], recent >= self.sinks], dim=1)
        return idx.clamp(min=0), valid

    def view(self, lengths: torch.Tensor) -> ContextView:
        idx, valid = self.indices(lengths)
        idx, valid = idx[:, None], valid[:, None]  # shared by every KV head and layer
        return lambda layer: (idx, valid)

    def describe(self) -> str:
        return f"streaming(sinks={self.sinks}, window={self.window})"


class SnapKVPolicy(DraftKVPolicy):
    name = "snapkv"

    def __init__(self, budget: int, window: int = 32, kernel: int = 5, pool: str = "avg"):
        if budget < 1 or window < 1:
            raise ConfigError(f"snapkv draft KV needs budget >= 1 and window >= 1, got budget={budget}, window={window}")
        if budget < window:
            raise ConfigError(f"snapkv draft KV keeps the whole observation window, so it needs budget >= window; "
                              f"got budget={budget}, window={window} (pass a smaller --window)")
        if kernel < 1 or kernel % 2 == 0:
            raise ConfigError(f"snapkv pooling kernel must be odd and >= 1, got {kernel}")
        if pool not in ("avg", "max"):
            raise ConfigError(f"snapkv pooling must be 'avg' or 'max', got {pool!r}")
        self.budget, self.window, self.kernel, self.pool = budget, window, kernel, pool
        self.selected: list[torch.Tensor | None] = []  # per layer: [B, Hkv, K] slot indices
        self.selected_valid: list[torch.Tensor | None] = []  # per layer: [B, Hkv, K]
        self.obs_start: torch.Tensor | None = None  # [B] first slot of each row's observation window
        self.prompt_lengths: torch.Tensor | None = None  # [B]
        self._observed: list[bool] = []

    def start(self, prompt_lengths: torch.Tensor, num_layers: int) -> None:
        # The selection lives in buffers that are reused (filled in place) while the batch shape stays
        # the same, so a draft step captured in a CUDA graph reads the current generation's selection.
        B = prompt_lengths.shape[0]
        if self.prompt_lengths is None or self.prompt_lengths.shape != prompt_lengths.shape \
                or self.prompt_lengths.device != prompt_lengths.device or len(self.selected) != num_layers:
            self.version += 1
            self.prompt_lengths = torch.zeros_like(prompt_lengths)
            self.obs_start = torch.zeros_like(prompt_lengths)
            self.selected = [None] * num_layers
            self.selected_valid = [None] * num_layers
        self.prompt_lengths.copy_(prompt_lengths)
        self.obs_start.copy_((prompt_lengths - self.window).clamp(min=0))
        self._observed = [False] * num_layers
        self._batch = B

    def prefill_observer(self) -> Observer:
        return self.observe

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Pooled, group-summed observation-window attention to each prefix slot: [B, Hkv, S] float32.

        q: [B, Hq, T, D] prefill queries (row b's prompt occupies positions [0, len_b)); k: [B, Hkv, S, D].
        Slots outside a row's prefix [0, obs_start) score -inf.
        """
        assert self.obs_start is not None
        B, Hq, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = Hq // Hkv
        dev = q.device
        # Query positions of the observation window, right-aligned at each row's last prompt token.
        qpos = self.prompt_lengths[:, None] - self.window + torch.arange(self.window, device=dev)  # [B, w]
        qvalid = qpos >= 0
        qsel = torch.gather(q, 2, qpos.clamp(min=0)[:, None, :, None].expand(B, Hq, self.window, D))
        qsel = qsel.float().view(B, Hkv, G * self.window, D)
        logits = qsel @ k.float().transpose(-1, -2) / D**0.5  # [B, Hkv, G*w, S]
        kpos = torch.arange(S, device=dev)
        causal = kpos[None, None, :] <= qpos[:, :, None]  # [B, w, S]
        logits = logits.view(B, Hkv, G, self.window, S).masked_fill(~causal[:, None, None], float("-inf"))
        attn = logits.softmax(-1).nan_to_num(0.0) * qvalid[:, None, None, :, None]
        votes = attn.sum(dim=3)  # [B, Hkv, G, S] — summed over the window queries, per query head
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

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> None:
        votes = self.scores(q, k)  # [B, Hkv, S]
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

    def view(self, lengths: torch.Tensor) -> ContextView:
        assert self.obs_start is not None and all(self._observed), "snapkv: no prefill seen"
        dev = lengths.device
        sel = torch.stack(self.selected)  # [L, B, Hkv, K]
        sel_valid = torch.stack(self.selected_valid)
        n_sel = sel_valid.sum(-1)  # [L, B, Hkv]
        recent_n = self.budget - n_sel  # [L, B, Hkv] slots left for the recent part
        R = self.budget  # ≥ every recent_n: a static width (no host sync); extra entries are invalid
        recent = lengths[:, None] - R + torch.arange(R, device=dev)  # [B, R]
        lo = torch.maximum(lengths[None, :, None] - recent_n, self.obs_start[None, :, None])  # [L, B, Hkv]
        recent_valid = recent[None, :, None, :] >= lo[..., None]
        recent = recent.clamp(min=0)[None, :, None, :].expand_as(recent_valid)
        idx = torch.cat([sel, recent], dim=-1)
        valid = torch.cat([sel_valid, recent_valid], dim=-1)
        return lambda layer: (idx[layer], valid[layer])

    def describe(self) -> str:
        return f"snapkv(budget={self.budget}, window={self.window}, kernel={self.kernel}, pool={self.pool})"


def make_policy(name: str, budget: int | None = None, sinks: int | None = None, window: int | None = None,
                kernel: int = 5, pool: str = "avg") -> DraftKVPolicy:
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
