"""Which requests run in each step: an FCFS queue, batch slots, chunked prefill, preemption. No tensors.

Terms.
- `all_token_ids` = prompt + output so far. `num_computed`: how many of them (from the start) have their
  KV in the request's blocks.
- A request is *prefilling* while num_computed < `prefill_len`, the length of all_token_ids when it was
  (re)admitted: a prefill computes the KV of every known token, and the logits of the last one sample the
  next token. Prefill runs in *chunks* (request, start, length) with start == num_computed.
- A *decode row* is a running request whose prefill is done. It holds num_computed == len(all_token_ids)
  - 1: its newest token is known, its KV not yet computed. A step feeds that token (and, speculating,
  draft tokens after it), writing KV at positions num_computed .. num_computed + `lookahead` - 1
  (lookahead = 1 for an AR step, the tree size for a speculative one), then commits k tokens: the
  newest one plus the accepted drafts get their KV kept (num_computed += k) and k new tokens (accepted
  drafts + the bonus) join the output — so the invariant holds again.
- *Preemption* (recompute): when the pool cannot give a decode row its lookahead room, the running
  request that arrived last loses its blocks and slot, and waits again, in arrival order (ahead of every
  request never admitted); on readmission it prefills prompt + output so far from scratch.

Policy.
- FCFS by arrival: the waiting queue stays sorted by arrival, only its head is admitted, and preemption
  picks the latest arrival, so the oldest running request is never preempted while others run.
- Each step: every decode row first gets its lookahead room (preempting as needed); then up to
  `max_prefill_requests` prefill chunks (one per request) within the step's `max_num_batched_tokens`
  budget — first the running requests whose prefill is unfinished (oldest first), then waiting heads
  while a slot is free (lowest slot first) and no preemption happened this step. The budget bounds the
  prefill tokens of a step only; decode rows are bounded by max_num_seqs * lookahead on their own. A
  chunk is the rest of the prefill, capped by the budget left and by what the free blocks can hold.
- Prefill first (`prefill_first=True`, SGLang's order): a step that has prefill chunks to run runs them
  alone and its decoding rows wait a step; the rows decode when no prompt can proceed. A waiting request is
  admitted then only if its whole prompt leaves a block free for every decoding row (else the next decode
  step would preempt it straight away). A burst of requests then prefills first and decodes together — at
  the width where a step's fixed costs (weights, a speculative step's draft levels) are shared by the most
  rows — at the price of the early rows' inter-token latency while the burst prefills.
- Lengths: len(all_token_ids) never exceeds max_model_len nor prompt + max_new_tokens; reaching either
  finishes the request with FINISHED_LENGTH. A prompt of max_model_len tokens or more is refused at
  `add`, as is a request the whole pool could not hold even alone.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from redwood.errors import ConfigError, ContextLengthError
from redwood.kv.blocks import BlockPool, BlockTable


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # a stop condition (EOS, stop string), seen by the Engine
    FINISHED_LENGTH = "length"  # max_new_tokens or max_model_len reached (the Engine tells "length" from "context")
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


@dataclass(eq=False)
class SeqState:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens of all_token_ids whose KV is in block_table
    prefill_len: int = 0  # len(all_token_ids) at the last admission
    slot: int | None = None  # batch row while running
    block_table: BlockTable | None = None
    arrival: int = -1  # order of `add`
    num_preemptions: int = 0
    # At most this many leading tokens may come from the prefix cache (None: any; SnapKV must compute
    # its observation window, see DraftKVPolicy.prefix_limit).
    prefix_limit: int | None = None
    # Output tokens it generates for certain (max_new_tokens when nothing but the length can end it: EOS ignored,
    # no stop strings; else 0) — what the automatic policy may count on a queued prefill decoding afterwards
    sure_new_tokens: int = 0
    arrived_after: int = 0  # output tokens the scheduler had recorded (all requests) when this one was added
    first_token_after: int | None = None  # ... when this one's first output token came (None: not yet)

    def __post_init__(self) -> None:
        # prompt + output, kept as one list (`extend_output`): every step reads it for every decoding row (the
        # draftless drafters' history), and a 16K-token prompt's concatenation per row and step was milliseconds
        # of host time a step at batch 64
        self._all = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """prompt + output (the request's own list: read it, never change it)."""
        return self._all

    def extend_output(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self._all.extend(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.status is Status.RUNNING and self.num_computed < self.prefill_len


@dataclass
class PrefillChunk:
    request: SeqState
    start: int  # == request.num_computed when scheduled
    length: int  # prefill the KV of all_token_ids[start:start + length]

    @property
    def is_last(self) -> bool:
        """Whether this chunk ends the prefill (its last logits sample the next token)."""
        return self.start + self.length == self.request.prefill_len


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk]  # at most max_prefill_requests, one per request
    decode: list[SeqState]  # decode rows, oldest first; each has its slot and lookahead room
    preempted: list[SeqState]  # lost their slot this step
    admitted: list[SeqState]  # got a slot this step (new, or back after a preemption)
    num_waiting: int
    num_running: int
    num_blocks_used: int
    num_blocks_free: int


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pool: BlockPool,
        lookahead: int,
        max_model_len: int,
        max_prefill_requests: int = 1,
        prefill_first: bool = False,
    ):
        for name, value, low in (
            ("max_num_seqs", max_num_seqs, 1),
            ("lookahead", lookahead, 1),
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("max_model_len", max_model_len, 2),
        ):
            if value < low:
                raise ConfigError(f"{name} must be at least {low}, got {value}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.lookahead = lookahead
        self.max_model_len = max_model_len
        self.max_prefill_requests = max(1, max_prefill_requests)  # prefill chunks (one per request) per step
        self.prefill_first = prefill_first
        self.waiting: list[SeqState] = []  # sorted by arrival
        self.running: list[SeqState] = []  # sorted by arrival
        self._free_slots = list(range(max_num_seqs))  # a heap
        self._requests: dict[str, SeqState] = {}  # unfinished, by id
        self._arrivals = 0
        self._emitted = 0  # output tokens recorded so far, all requests (the clock `arrived_after` reads)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def prefill_backlog_steps(self) -> int:
        """Steps the prefills that can proceed now still need at `max_num_batched_tokens` a step: the unfinished
        prefills of running requests and the prompts of as many waiting requests as there are free slots
        (those behind them wait for a slot — for decoding rows to finish — not for prefill budget)."""
        prefilling, admittable = self._prefill_backlog()
        tokens = sum(r.prefill_len - r.num_computed for r in prefilling) + sum(r.num_tokens for r in admittable)
        return -(-tokens // self.max_num_batched_tokens)

    def _prefill_backlog(self) -> tuple[list[SeqState], list[SeqState]]:
        """The requests of that backlog: running ones still prefilling, waiting ones up to the free slots."""
        return [r for r in self.running if r.is_prefilling], self.waiting[: len(self._free_slots)]

    def backlog_then_decodes(self) -> int:
        """Output tokens every request of that backlog is sure to generate once its prefill is done (the fewest
        of their `sure_new_tokens`, less what a preempted one has). 0 — nothing to count on — with no backlog,
        while requests wait behind it for a slot (a decoding row that ends sooner lets one in sooner: its
        tokens are worth having early), or when a backlog request came after a decoding row had begun its
        output: a stream, not one burst (a closed-loop client sends its next request when one ends, so rows
        that end sooner bring the next arrivals sooner)."""
        prefilling, admittable = self._prefill_backlog()
        backlog = prefilling + admittable
        if not backlog or len(self.waiting) > len(self._free_slots):
            return 0
        started = [r.first_token_after for r in self.running if not r.is_prefilling and r.first_token_after is not None]
        if started and max(r.arrived_after for r in backlog) > min(started):
            return 0
        return min(max(r.sure_new_tokens - len(r.output_token_ids), 0) for r in backlog)

    def get(self, request_id: str) -> SeqState | None:
        return self._requests.get(request_id)

    def add(self, request: SeqState) -> None:
        n = len(request.prompt_token_ids)
        if request.request_id in self._requests:
            raise ConfigError(f"request id {request.request_id!r} is already in use")
        if n == 0:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        if request.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens; the model's context is {self.max_model_len} tokens, which "
                f"leaves no room to generate: shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        final = min(n + request.max_new_tokens, self.max_model_len)
        # Most KV it can ever hold: its last prefill covers <= final - 1 tokens, its last decode step
        # starts at num_computed <= final - 2 and writes lookahead positions.
        need = self.pool.blocks_for(max(final - 1, final - 2 + self.lookahead))
        if need > self.pool.num_blocks:
            raise ContextLengthError(
                f"request {request.request_id!r} may need {need} KV blocks ({n} prompt + up to "
                f"{final - n} new tokens), more than the whole pool's {self.pool.num_blocks} blocks of "
                f"{self.pool.block_size} tokens: give the KV cache more memory or ask for fewer tokens"
            )
        request.status = Status.WAITING
        request.arrival = self._arrivals
        request.arrived_after = self._emitted
        request.num_computed = request.prefill_len = 0
        request.block_table = BlockTable(self.pool.block_size)
        self._arrivals += 1
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        if self.prefill_first:
            rows = sum(1 for r in self.running if r.status is Status.RUNNING and not r.is_prefilling)
            prefill, admitted = self._prefill_chunks(reserve=rows)
            if prefill:  # (the decoding rows wait: nothing was allocated for them, nobody preempted)
                return self._output(prefill, [], [], admitted)
        preempted: list[SeqState] = []
        decode: list[SeqState] = []
        for req in list(self.running):  # oldest first; victims come off the newest end
            if req.status is not Status.RUNNING or req.is_prefilling:
                continue
            while not req.block_table.ensure(req.num_computed + self.lookahead, self.pool):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    raise RuntimeError(
                        f"the KV pool ({self.pool.num_blocks} blocks) cannot hold request {req.request_id!r} alone"
                    )
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                decode.append(req)

        prefill, admitted = self._prefill_chunks(admit=not preempted)
        return self._output(prefill, decode, preempted, admitted)

    def _output(self, prefill, decode, preempted, admitted) -> SchedulerOutput:
        return SchedulerOutput(
            prefill,
            decode,
            preempted,
            admitted,
            len(self.waiting),
            len(self.running),
            self.pool.num_used,
            self.pool.num_free,
        )

    def _prefill_chunks(
        self, admit: bool = True, reserve: int | None = None
    ) -> tuple[list[PrefillChunk], list[SeqState]]:
        """This step's prefill chunks within the token budget — the running requests' unfinished prefills first
        (oldest first), then waiting heads while a slot is free (admitted: they take the slot); admit=False
        admits nobody (a preemption happened this step). reserve: blocks a waiting request's whole prompt must
        leave free to be admitted (prefill first: one for every decoding row)."""
        admitted: list[SeqState] = []
        prefill: list[PrefillChunk] = []
        budget = self.max_num_batched_tokens
        blocked = False  # an unfinished prefill got no room: nobody behind it starts
        for req in self.running:  # unfinished prefills first, oldest first
            if req.is_prefilling and len(prefill) < self.max_prefill_requests and budget > 0:
                chunk = self._chunk(req, budget)
                if chunk is None:
                    blocked = True
                    break
                prefill.append(chunk)
                budget -= chunk.length
        while (
            not blocked
            and admit
            and self.waiting
            and self._free_slots
            and budget > 0
            and len(prefill) < self.max_prefill_requests
        ):
            req = self.waiting[0]
            req.prefill_len = req.num_tokens
            if self.pool.enable_prefix_cache:
                ids = req.all_token_ids
                if req.prefix_limit is not None:
                    ids = ids[: req.prefix_limit + 1]  # (a match covers at most len(ids) − 1 tokens)
                req.num_computed = req.block_table.match_prefix(ids, self.pool)
            fits = reserve is None or (
                self.pool.blocks_for(req.prefill_len) - len(req.block_table.blocks) + reserve <= self.pool.num_free
            )
            chunk = self._chunk(req, budget) if fits else None
            if chunk is None:  # not even one token fits (or, prefill first, not the whole prompt): stay at the head
                req.block_table.release(self.pool)
                req.num_computed = 0
                break
            self.waiting.pop(0)
            req.status = Status.RUNNING
            req.slot = heapq.heappop(self._free_slots)
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            admitted.append(req)
            prefill.append(chunk)
            budget -= chunk.length
        return prefill, admitted

    def _chunk(self, req: SeqState, budget: int) -> PrefillChunk | None:
        """The next prefill chunk of req (at most `budget` tokens), its blocks allocated; None if no
        token fits."""
        table, start = req.block_table, req.num_computed
        room = (len(table.blocks) + self.pool.num_free) * self.pool.block_size - start
        length = min(req.prefill_len - start, budget, room)
        if length <= 0:
            return None
        if not table.ensure(start + length, self.pool):  # cannot happen: room counts the free blocks
            raise RuntimeError("prefill chunk blocks vanished")
        return PrefillChunk(req, start, length)

    def _preempt(self, req: SeqState) -> None:
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = req.prefill_len = 0
        req.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def _release(self, req: SeqState) -> None:
        """Take req out of the running or waiting set, freeing its blocks and slot."""
        req.block_table.release(self.pool)
        if req.slot is not None:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None
        (self.running if req.status is Status.RUNNING else self.waiting).remove(req)

    def update_after_step(
        self, request: SeqState, num_computed: int, new_token_ids: Sequence[int] = (), stopped: bool = False
    ) -> list[int]:
        """Record a step's result for a running request; returns the tokens appended to its output.

        num_computed: tokens whose KV this step wrote and keeps (a chunk's length; for a decode row, the
        fed token plus the accepted drafts, i.e. len(new_token_ids)). new_token_ids: tokens it generated
        (none for a chunk that does not end the prefill; the sampled token for the last chunk; accepted
        drafts + bonus for a decode row). The Engine cuts them after a stop token (and num_computed with
        them) and says stopped=True; the scheduler cuts them at the length limits, and finishes the
        request (freeing its blocks and slot) on either.
        """
        if request.status is not Status.RUNNING:
            raise ValueError(f"update_after_step: request {request.request_id!r} is {request.status.value}")
        before, computed = request.num_tokens, request.num_computed + num_computed
        prefilling = computed < request.prefill_len  # still, after this step
        if num_computed < 0 or computed > request.block_table.capacity:
            raise ValueError(
                f"request {request.request_id!r} cannot have computed {computed} tokens: its "
                f"blocks hold {request.block_table.capacity} positions"
            )
        if request.is_prefilling and computed > request.prefill_len:
            raise ValueError(f"a prefill chunk of {request.request_id!r} ran past its prefill")
        if prefilling and new_token_ids:
            raise ValueError("only the chunk that ends a prefill samples a token")
        if not prefilling and computed != before + len(new_token_ids) - 1:
            raise ValueError(
                f"request {request.request_id!r}: {num_computed} computed tokens do not match "
                f"{len(new_token_ids)} new tokens (a token would be dropped or duplicated)"
            )
        request.num_computed = computed
        room = min(request.max_new_tokens - len(request.output_token_ids), self.max_model_len - before)
        kept = list(new_token_ids[:room])
        if kept and request.first_token_after is None:
            request.first_token_after = self._emitted
        self._emitted += len(kept)
        request.extend_output(kept)
        if self.pool.enable_prefix_cache:
            request.block_table.register_full(request.prompt_token_ids, request.num_computed, self.pool)
        if len(kept) == room:
            self.finish(
                request,
                Status.FINISHED_LENGTH if len(kept) < len(new_token_ids) or not stopped else Status.FINISHED_STOPPED,
            )
        elif stopped:
            self.finish(request, Status.FINISHED_STOPPED)
        return kept

    def finish(self, request: SeqState, reason: Status) -> bool:
        """End an unfinished request (any state), freeing its blocks and slot; False if already ended."""
        if not reason.finished:
            raise ValueError(f"finish: {reason} is not a finish reason")
        if self._requests.get(request.request_id) is not request:
            return False
        self._release(request)
        request.status = reason
        del self._requests[request.request_id]
        return True

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        return req is not None and self.finish(req, Status.FINISHED_ABORTED)
