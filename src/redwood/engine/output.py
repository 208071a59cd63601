"""A step's output on the host: tokens to requests (up to a stop), text, stats, deltas.

`OutputProcessor.process` gives each request its step tokens (`executor.Tokens`) and says what the
scheduler must record (`Update`); after the scheduler has applied the length limits, `deltas` builds
what the step returns — a `RequestDelta` per request that got tokens or ended — and drops the finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redwood.engine.batch import StepBatch, StepResult, Tokens
from redwood.engine.request import RequestState, TokenLogprob
from redwood.engine.scheduler import SeqState
from redwood.sampling_params import SamplingParams


@dataclass
class RequestDelta:
    """What one step produced for one request.

    sources[i] / logprobs[i] belong to token_ids[i]: "draft" for a draft token the target accepted,
    "target" for a token sampled from the target (the prefill's first token, a correction, the bonus
    token; every token of autoregressive decoding); the target's raw log-probabilities (`TokenLogprob`)
    when the request set SamplingParams.logprobs (else None). spans: `text` cut into (text, source)
    runs, one per token whose characters it holds, in order — "".join(t for t, _ in spans) == text; a
    token's characters may come in a later delta than the token (text held back for stop strings or an
    incomplete UTF-8 sequence), and a token that adds no text (EOS, part of a character) has no span.
    """

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text (held back while it could begin a stop string)
    finish_reason: str | None  # None while running; "stop", "length", "context" or "abort" on its last delta
    stats: dict | None = None  # on the last delta: RequestStats.to_dict()
    prompt_token_ids: list[int] | None = None  # on the last delta
    sources: list[str] = field(default_factory=list)  # per new token: "draft" | "target"
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asked for logprobs
    spans: list[tuple[str, str]] = field(default_factory=list)  # text as (piece, source) per token


@dataclass
class Request:
    """The Engine's record of one unfinished request."""

    seq: SeqState  # the scheduler's view
    state: RequestState  # output, text, stop conditions, stats
    params: SamplingParams
    slot: int | None = None
    random_state: tuple | None = None  # the random stream kept across a preemption
    t_added: float = 0.0
    t_first: float | None = None
    capture_at_first: float = 0.0  # the executor's capture_s when the first token came (decode_s leaves captures out)
    sent: int = 0  # output tokens already in deltas


@dataclass
class Update:
    """What the scheduler records for one request after a step (`Scheduler.update_after_step`'s
    arguments): num_computed tokens whose KV the step keeps, the tokens kept (cut after a stop), stopped."""

    request: Request
    num_computed: int
    token_ids: list[int] = field(default_factory=list)
    stopped: bool = False
    emits: bool = False  # a delta goes out (the request got tokens)


class OutputProcessor:
    """Turns step results into request state and deltas (one per Engine; `requests` is the Engine's)."""

    def __init__(self, requests: dict[str, Request], executor):
        self.requests, self.executor = requests, executor

    def process(
        self, batch: StepBatch, result: StepResult, decode: list[Request], prefill: list[Request]
    ) -> list[Update]:
        """Append each request's new tokens (stopping at EOS / a stop string) and record its timings and
        speculation counts; → the scheduler's updates, decode rows first, in the batch's order."""
        updates = []
        for rec, tokens in zip(decode, result.decode):
            spec = rec.state.stats.spec
            if spec is not None:
                spec.step_s += result.step_s
                spec.draft_s += result.draft_s
                spec.verify_s += result.verify_s
            kept = self._append(rec, tokens)
            updates.append(Update(rec, len(kept), kept, rec.state.finish_reason == "stop", emits=True))
        for rec, work, tokens in zip(prefill, batch.prefill, result.prefill):
            rec.state.stats.prefill_s += result.prefill_s
            length = work.stop - work.start
            if tokens is None:
                updates.append(Update(rec, length))
                continue
            if rec.t_first is None:
                rec.t_first, rec.capture_at_first = time.perf_counter(), self.executor.capture_s
            kept = self._append(rec, tokens)
            updates.append(Update(rec, length, kept, rec.state.finish_reason == "stop", emits=True))
        return updates

    @staticmethod
    def _append(rec: Request, tokens: Tokens) -> list[int]:
        """Give the request its tokens up to a stop; → those kept."""
        state, kept = rec.state, []
        for i, tok in enumerate(tokens.token_ids):
            kept.append(tok)
            if state.append(tok, tokens.sources[i], None if tokens.logprobs is None else tokens.logprobs[i]):
                break
        if tokens.spec is not None:
            state.stats.spec.record(tokens.spec[0], emitted=len(kept), drafted=tokens.spec[1])
        return kept

    def deltas(self, updates: list[Update]) -> list[RequestDelta]:
        """After the scheduler's update: the deltas of the requests that got tokens; a finished request
        gets its finish reason and stats, and leaves `requests`."""
        out = []
        for u in updates:
            if not u.emits:
                continue
            rec = u.request
            state, seq = rec.state, rec.seq
            if seq.status.finished:
                if state.finish_reason is None:  # the scheduler's length limits
                    state.finish_reason = state.length_reason()
                now = time.perf_counter()
                state.stats.decode_s = now - (rec.t_first or now) - (self.executor.capture_s - rec.capture_at_first)
                del self.requests[seq.request_id]
            out.append(delta(rec))
        return out


def delta(rec: Request) -> RequestDelta:
    """The request's output since its last delta."""
    state, sent = rec.state, rec.sent
    rec.sent = len(state.output_ids)
    done = state.finish_reason is not None
    text, spans = state.pop_delta_spans()
    logprobs = None if rec.params.logprobs is None else state.output_logprobs[sent:]
    return RequestDelta(
        rec.seq.request_id,
        state.output_ids[sent:],
        text,
        state.finish_reason,
        state.stats.to_dict() if done else None,
        state.prompt_ids if done else None,
        sources=state.output_sources[sent:],
        logprobs=logprobs,
        spans=spans,
    )
