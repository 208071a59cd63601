"""One request's progress: generated tokens, incremental text, and when (and why) it stops."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from redwood.sampling_params import SamplingParams

# Where an output token came from (`RequestState.output_sources`, `RequestDelta.sources`).
SOURCE_DRAFT = "draft"  # a draft token the target accepted
SOURCE_TARGET = "target"  # sampled from the target: the prefill's first token, a correction, a bonus, AR decoding

# Why a request finished (`RequestState.finish_reason`, `RequestDelta.finish_reason`).
FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_new_tokens generated
# The sequence filled the model's context (max_model_len) before max_new_tokens. vLLM reports "length" for
# both; llama.cpp's server stops both as STOP_TYPE_LIMIT ("length") but flags the context case `truncated`.
# Kept distinct because the remedies differ: "length" means ask for more tokens, "context" that no more fit
# (shorten the prompt, raise --max-model-len). The OpenAI wire knows only "stop" / "length": the server
# sends "length" and keeps "context" in its `redwood` extension.
FINISH_CONTEXT = "context"
FINISH_ABORT = "abort"  # `Engine.abort` (a server's client went away)


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the target's raw distribution (log-softmax of its
    logits at temperature 1, before top-k / top-p: vLLM's default), and the `top` most likely tokens
    there as (token id, logprob) pairs, most likely first (as many as the request's `logprobs` asked)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob_list(
    tokens: list[int], chosen: list[float], top_values: list[list[float]], top_ids: list[list[int]], k: int
) -> list[TokenLogprob]:
    """One row of `token_logprobs`' output on the host (positions aligned with `tokens`; the device
    computed 20 alternatives, the request keeps k)."""
    return [TokenLogprob(t, chosen[j], list(zip(top_ids[j][:k], top_values[j][:k]))) for j, t in enumerate(tokens)]


@dataclass
class SpecStats:
    """Speculation counters of one request.

    steps: target verification steps; drafted: draft tokens proposed (γ per step, fewer on a step the
    engine shortened for a request near its end); accepted: draft tokens accepted; accepted_at[i]: steps
    whose draft token i (0-based) was accepted. acceptance rate = accepted / drafted; mean accepted
    length = (accepted + steps) / steps — tokens per target step including the correction/bonus token
    (vLLM's and SGLang's definition).

    Only emitted tokens count: on the step a stop (EOS, a stop string, the length limit) cuts, accepted
    is the draft tokens emitted, not those the verifier accepted past the stop — `--gamma 60
    --max-new-tokens 8` on a graphed step reports 7 accepted, not 60 (and 8 tokens/step: the definition
    counts a bonus on every step, one too many on a step cut inside its drafts). Eager greedy steps are
    cut to what a request can still emit (`Executor._step_tree`), so there the counts are exact.
    """

    gamma: int  # draft depth: tokens a step can accept (γ for a chain, tree depth − 1)
    drafted_per_step: int = 0  # draft tokens per step (γ for a chain, tree size − 1); 0 → gamma
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # drafting time, when measured apart (eager steps; 0 when a step is one graph)
    verify_s: float = 0.0  # verification time, when measured apart
    step_s: float = 0.0  # whole steps: draft + verify on the device, then the host's bookkeeping and commit
    policy: str = "fixed"  # "auto": the automatic policy chose each step's plan (`speculation.policy`)
    plans: dict[str, int] = field(default_factory=dict)  # plan name ("ar", "ngram γ4", …) → steps it ran
    probes: int = 0  # of those, steps the automatic policy ran to re-measure a plan it had not chosen

    def count_plan(self, name: str, probe: bool = False) -> None:
        """One decoding step of this request ran plan `name` (`speculation.policy`)."""
        self.plans[name] = self.plans.get(name, 0) + 1
        self.probes += bool(probe)

    def record(self, accepted: int, emitted: int | None = None, drafted: int | None = None) -> None:
        """One step: `accepted` draft tokens accepted by the verifier, `emitted` (>= 1) tokens given to
        the request (default accepted + 1: nothing cut), `drafted` draft tokens (default the per-step count)."""
        if not self.accepted_at:
            self.accepted_at = [0] * self.gamma
        if emitted is not None:
            accepted = min(accepted, emitted)
        self.steps += 1
        self.drafted += drafted if drafted is not None else (self.drafted_per_step or self.gamma)
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def to_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "drafted_per_step": self.drafted_per_step or self.gamma,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_accepted_length": round((self.accepted + self.steps) / self.steps, 4) if self.steps else 0.0,
            "acceptance_by_position": [round(a / self.steps, 4) for a in self.accepted_at] if self.steps else [],
            "accepted_by_position": list(self.accepted_at),  # exact counts (steps that accepted position i)
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "step_s": round(self.step_s, 6),
            "policy": self.policy,
            "plans": dict(self.plans),
            "probes": self.probes,
        }


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token to last, less one-time CUDA-graph captures (as step/draft/verify_s)
    spec: SpecStats | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes out of the prefill; decode throughput counts the rest.
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
        }
        if self.spec is not None:
            d["speculative"] = self.spec.to_dict()
        return d


def _decode_stream(tokenizer):
    """A `DecodeStream` over the tokenizer's Rust backend, or None where its text could differ from
    `tokenizer.decode(ids, skip_special_tokens=True)` (a slow tokenizer; one that cleans up spaces)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return DecodeStream(skip_special_tokens=True)


@dataclass
class RequestState:
    """A request being generated.

    finish_reason: None while running; "stop" (EOS or a stop string), "length" (params.max_new_tokens
    generated) or "context" (the model's context filled first: `max_new_tokens` is capped by what the
    context leaves after the prompt; reaching both at once is "length") once done. Text is detokenized
    incrementally; `pop_delta` returns the text added since its last call (held back while the tail is
    an incomplete UTF-8 sequence). A fast (Rust) tokenizer detokenizes through its own incremental
    decoder (`tokenizers.decoders.DecodeStream`); others through two `decode` calls over a short window
    per token, which at large batch was a visible share of a step's host time (docs/perf/engine.md,
    session 11). Text is made when needed — every token when stop strings must be checked, else
    when `text` / `pop_delta` is read.

    Per output token (aligned with output_ids): its source ("draft" / "target") and, when the request
    asked for logprobs, its `TokenLogprob`. Text spans: as the detokenizer extends the text, each
    token's end offset in it is recorded, so `pop_delta_spans` can cut the emitted text at token
    boundaries — a token's characters may be emitted in a later delta than the token itself (held-back
    text), and a token that adds no text (EOS, part of a UTF-8 sequence) has no characters.
    """

    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: object | None
    eos_ids: frozenset[int]
    max_new_tokens: int  # params.max_new_tokens capped by the context left after the prompt
    output_ids: list[int] = field(default_factory=list)
    output_sources: list[str] = field(default_factory=list)  # per output token: SOURCE_DRAFT / SOURCE_TARGET
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs
    _text: str = ""
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _emitted: int = 0
    _stop_checked: int = 0  # text before this index holds no stop string
    _detokenized: int = 0  # output tokens already turned into text
    _text_tokens: int | None = None  # output tokens that make text (None: all; an ending EOS does not)
    _text_ends: list[int] = field(default_factory=list)  # per detokenized token: len(_text) after it
    _stream: object | None = None  # the fast tokenizer's DecodeStream, made on first use (False: none)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, source: str = SOURCE_TARGET, logprob: TokenLogprob | None = None) -> bool:
        """Add one generated token (where it came from, and its logprob when the request asked for
        them); returns True when the request is finished."""
        assert self.finish_reason is None
        self.output_ids.append(token)
        self.output_sources.append(source)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self.stats.generated_tokens = len(self.output_ids)
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = FINISH_STOP
            self._text_tokens = len(self.output_ids) - 1
            return True
        if self.params.stop and self._check_stop():
            self.finish_reason = FINISH_STOP
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = self.length_reason()
        return self.finished

    def length_reason(self) -> str:
        """The finish reason of a request stopped by a length limit: "length" once params.max_new_tokens
        tokens are out, else "context" (only the context's cap on `max_new_tokens` can stop it earlier)."""
        return FINISH_LENGTH if len(self.output_ids) >= self.params.max_new_tokens else FINISH_CONTEXT

    @property
    def text(self) -> str:
        """The generated text so far (stop string excluded once one is found)."""
        self._catch_up()
        return self._text

    def _catch_up(self) -> None:
        end = len(self.output_ids) if self._text_tokens is None else self._text_tokens
        while self._detokenized < end:
            self._detokenized += 1
            self._detokenize(self._detokenized)
            self._text_ends.append(len(self._text))

    def _detokenize(self, n: int) -> None:
        """Extend the text by output token n − 1 (tokens before it are already text)."""
        if self.tokenizer is None:
            return
        if self._stream is None:
            self._stream = _decode_stream(self.tokenizer) or False
        if self._stream:
            piece = self._stream.step(self.tokenizer.backend_tokenizer, self.output_ids[n - 1])
            if piece:  # (None while a UTF-8 sequence is incomplete)
                self._text += piece
            return
        ids = self.output_ids
        # Decode a short window (the previous token(s) give context for leading spaces / merges).
        before = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[self._prefix_offset : n], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, n

    def _check_stop(self) -> bool:
        self._catch_up()
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self._stop_checked - longest + 1)  # a stop string may straddle old and new text
        hits = [i for s in self.params.stop if (i := self._text.find(s, start)) >= 0]
        self._stop_checked = len(self._text)
        if hits:
            self._text = self._text[: min(hits)]
            return True
        return False

    def pop_delta(self) -> str:
        """Text not yet emitted. While running, hold back a tail that could begin a stop string."""
        return self.pop_delta_spans()[0]

    def pop_delta_spans(self) -> tuple[str, list[tuple[str, str]]]:
        """`pop_delta`'s text, and that text cut into (text, source) runs, one per output token whose
        characters lie in it, in order: "".join(t for t, _ in spans) == text."""
        end = len(self.text)
        if not self.finished and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1
            end = max(self._emitted, end - hold)
        start, self._emitted = self._emitted, end
        spans = []
        # Token i's characters are _text[_text_ends[i − 1]:_text_ends[i]]; the first token whose range
        # reaches past `start` holds the first emitted character. (A stop string only ever shortens the
        # text, so the ends past len(_text) are simply cut at `end`.)
        pos, i = start, bisect_right(self._text_ends, start)
        while pos < end:
            stop = min(self._text_ends[i], end)
            if stop > pos:
                spans.append((self._text[pos:stop], self.output_sources[i]))
                pos = stop
            i += 1
        return self._text[start:end], spans
