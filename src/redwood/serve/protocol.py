"""The OpenAI request bodies the server accepts (pydantic), and the OpenAI error shape.

Field names and defaults follow OpenAI's API reference: unknown fields are rejected (`extra="forbid"`,
as OpenAI does), except the documented extensions vLLM users send — `top_k`, `ignore_eos` — and
redwood's own `redwood: {"stats": true}`. Fields OpenAI defines that redwood does not implement
(penalties, logit_bias, echo, suffix, best_of ≠ n) are accepted only at their neutral value, so a client
that sends the defaults works and one that relies on them gets a clear 400 instead of a silent change.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MAX_N = 128  # choices per request


class APIError(Exception):
    """An error answered as OpenAI JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # (strict: "2" is not a number, true not 1)


class StreamOptions(_Strict):
    include_usage: bool = False


class RedwoodOptions(_Strict):
    """redwood's extension: `stats` adds per-request speculation stats (and, streaming, token spans)."""

    stats: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # (OpenAI: an end-user id for abuse monitoring; recorded nowhere here)
    # extensions (vLLM's)
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    redwood: RedwoodOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("temperature must be a finite number >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @model_validator(mode="after")
    def _neutral_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported by redwood (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by redwood")
        return self

    @property
    def stats(self) -> bool:
        return self.redwood is not None and self.redwood.stats

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default: 16; None: up to the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported by redwood")
        if self.suffix:
            raise ValueError("suffix is not supported by redwood")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by redwood (only best_of = n)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context
    max_completion_tokens: int | None = Field(None, ge=1)  # (OpenAI's newer name; wins over max_tokens)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (0: the chosen token's only), else None."""
        return (self.top_logprobs or 0) if self.logprobs else None
