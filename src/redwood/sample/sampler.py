"""Turning logits into a distribution and drawing tokens, per row of a batch, in float32.

`Sampler` holds each row's temperature / top-k / top-p and its random numbers (`RowRandom`: hashes on the
device, so sampling never synchronizes with the host and runs inside CUDA graphs; seeded rows are
reproducible whatever else is in the batch). Its `noise` says which numbers a token is drawn with:
"position" — the row seed's number at the token's absolute position, so the token at a position never
depends on how many draws came before it (the `match` verifier reads the same numbers, and a seeded
request's tokens are then the same under any speculation plan) — or "counter", the row's per-draw stream. `probabilities` is the exact distribution a row samples
from — speculative verifiers compare draft and target probabilities through the same function, so the
distribution they preserve is exactly the one plain decoding samples. `token_logprobs` is what a request
that asks for logprobs gets back: the target's raw log-probabilities, whatever the request samples with.
"""

from __future__ import annotations

import torch

from redwood.config import SAMPLING_NOISES
from redwood.errors import ConfigError
from redwood.sample.random import RowRandom, inverse_cdf
from redwood.sampling_params import MAX_LOGPROBS, SamplingParams


def probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_filter: bool | None = None,
    any_greedy: bool | None = None,
) -> torch.Tensor:
    """logits: [N, V]; temperature, top_k, top_p: [N] → probs [N, V] float32.

    Greedy rows (temperature 0) get a one-hot on the argmax (first index on ties, like torch.argmax).
    any_filter / any_greedy: whether some row uses top-k/top-p / is greedy, when the caller knows it
    (saves a host sync on the GPU); None → read from the tensors.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if any_filter is None:
        any_filter = bool(((top_k > 0) | (top_p < 1)).any())
    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if any_filter:
        V = logits.shape[-1]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None]
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        # Keep a token while the mass of the more likely tokens is still below top_p (the first always).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # (top_p = 1 filters nothing, even where rounding lets the cumulative mass reach 1 early)
        drop = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = scaled.softmax(-1)
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [B, A, V] at the positions that emitted tokens [B, A] → (the tokens' logprobs [B, A],
    the K = min(20, V) largest logprobs [B, A, K] (descending), their token ids [B, A, K]).

    Raw logprobs: the log-softmax of the logits at temperature 1, before top-k / top-p (vLLM's default),
    in float32. Always K = MAX_LOGPROBS alternatives on the device (a static shape for CUDA graphs); the
    host keeps the first k a request asked for.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[..., None])[..., 0]
    top = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return chosen, top.values, top.indices


class Sampler:
    """Per-row sampling state for a batch of requests; noise: "position" | "counter" (module docstring)."""

    def __init__(self, params: list[SamplingParams], device: torch.device, noise: str = "position"):
        if noise not in SAMPLING_NOISES:
            raise ConfigError(f"sampling noise must be one of {', '.join(SAMPLING_NOISES)}, got {noise!r}")
        self.device, self.noise = device, noise
        self.params = params
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        self.any_filter = any(p.top_k > 0 or p.top_p < 1 for p in params)
        self.random = RowRandom([p.seed for p in params], device)

    @classmethod
    def slots(cls, num_rows: int, device: torch.device, noise: str = "position") -> "Sampler":
        """A sampler for `num_rows` batch slots, every row greedy until `set_row` gives it a request."""
        return cls([SamplingParams()] * num_rows, device, noise)

    def set_row(self, row: int, params: SamplingParams, seed_state=None) -> None:
        """Row `row` now samples for a request with `params`: its settings, and a fresh random stream from
        params.seed (or the stream `seed_state` = RowRandom.state(...) it had before a preemption). The
        flags are not updated: `view` sets them for the rows a step runs."""
        self.params[row] = params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        if seed_state is None:
            self.random.reseed(row, params.seed)
        else:
            self.random.set_state(row, seed_state)

    def view(self, lo: int, hi: int, active: list[SamplingParams]) -> "Sampler":
        """The sampler of rows [lo, hi), sharing this one's tensors, with flags from `active` — the
        parameters of the rows whose results count (the others' draws are discarded)."""
        other = Sampler.__new__(Sampler)
        other.device, other.noise = self.device, self.noise
        other.params = self.params[lo:hi]
        other.temperature, other.top_k, other.top_p = self.temperature[lo:hi], self.top_k[lo:hi], self.top_p[lo:hi]
        active = active or other.params
        other.all_greedy = all(p.greedy for p in active)
        other.any_greedy = any(p.greedy for p in active)
        other.any_filter = any(p.top_k > 0 or p.top_p < 1 for p in active)
        rnd = RowRandom.__new__(RowRandom)
        rnd.key, rnd.counter, rnd.batch_size = self.random.key[lo:hi], self.random.counter[lo:hi], hi - lo
        other.random = rnd
        return other

    def copy(self) -> "Sampler":
        """A sampler with the same settings and random state in separate device tensors."""
        other = Sampler.__new__(Sampler)
        other.__dict__.update(self.__dict__)
        other.temperature, other.top_k, other.top_p = self.temperature.clone(), self.top_k.clone(), self.top_p.clone()
        other.random = self.random.copy()
        return other

    def load_state(self, other: "Sampler") -> None:
        """Take another batch's settings and random state into this sampler's tensors, in place (a
        captured graph keeps reading these tensors). The host-side flags must match."""
        if (other.all_greedy, other.any_greedy, other.any_filter, other.noise) != (
            self.all_greedy,
            self.any_greedy,
            self.any_filter,
            self.noise,
        ) or other.temperature.shape != self.temperature.shape:
            raise ValueError("load_state needs a sampler of the same batch size, sampling flags and noise")
        self.params = other.params
        self.temperature.copy_(other.temperature)
        self.top_k.copy_(other.top_k)
        self.top_p.copy_(other.top_p)
        self.random.load_state(other.random)

    def probs(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [N, V] for batch rows `rows` ([N] indices; None → all rows in order)."""
        flags = dict(any_filter=self.any_filter, any_greedy=self.any_greedy)  # over all rows: a superset
        if rows is None:
            return probabilities(logits, self.temperature, self.top_k, self.top_p, **flags)
        return probabilities(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], **flags)

    def position_uniforms(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float64 uniforms keyed by (row seed, absolute position): positions [N, ...] of batch rows
        `rows` [N] (None → row i) → [N, ...] (`RowRandom.positional`; no counter advanced). The token at
        position P is drawn with the number at P — by `sample` under position noise, and by the `match`
        verifier and its coupled drafts under either noise."""
        return self.random.positional(rows, positions)

    def sample(self, logits: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [B, V] → next tokens [B] (argmax for greedy rows, a draw from `probs` otherwise).

        positions: [B] the absolute position of the token each row draws (its prompt's tokens are 0 …
        len − 1, the first sampled token is at len) — needed under position noise, where the draw is
        `inverse_cdf(probs, u(seed, position))`; under counter noise each call takes the rows' next draw.
        """
        if self.all_greedy:
            return logits.argmax(-1)
        if self.noise == "counter":
            u = self.random.uniform(None, (), torch.float64)
        elif positions is None:
            raise ValueError("a sampler with position noise needs the positions of the tokens it draws")
        else:
            u = self.position_uniforms(positions)
        drawn = inverse_cdf(self.probs(logits), u)
        return torch.where(self.temperature == 0, logits.argmax(-1), drawn) if self.any_greedy else drawn
