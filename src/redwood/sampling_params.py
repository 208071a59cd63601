"""Per-request decoding parameters (shaped like vLLM's `SamplingParams`), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from redwood.errors import ConfigError

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit); the step always computes this many


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 → greedy (argmax); > 0 → sample from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 or -1 → all). top_p: keep the smallest set of most likely
    tokens whose probability reaches top_p (1.0 → all). seed: a per-request random stream, so a seeded
    request samples the same tokens whatever else is in the batch. stop: strings that end generation
    (not included in the text). max_new_tokens: generated-token limit. ignore_eos: keep going past EOS
    (benchmarks with a fixed generation length). logprobs: None → off; k in [0, 20] → each generated
    token's log-probability under the target's raw distribution (temperature 1, before top-k / top-p)
    and the k most likely tokens there (OpenAI's `top_logprobs` limit is 20).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if (
            not isinstance(self.temperature, (int, float))
            or isinstance(self.temperature, bool)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ConfigError(
                f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}] (the most likely "
                f"alternatives returned per token), got {self.logprobs!r}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop strings must be non-empty strings, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
