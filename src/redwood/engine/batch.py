"""What the Engine hands the executor for a step (`StepBatch`) and gets back (`StepResult`): plain host values."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from redwood.engine.request import TokenLogprob
from redwood.sampling_params import SamplingParams


@dataclass
class DecodeRow:
    """A slot that generates this step; `remaining`: tokens its request may still emit (the tree cut);
    `computed`: its committed KV length (the cache's length on the host)."""

    slot: int
    params: SamplingParams
    remaining: int
    token_ids: list[int] | None = None  # prompt + output, `last` included (draftless drafters read it; the
    # draft model's catch-up feeds it)
    computed: int = 0


@dataclass
class PrefillWork:
    """One prefill chunk: prompt positions [start, stop) of `token_ids` into `slot`; the chunk that ends
    the prefill (`is_last`) samples the request's first token."""

    slot: int
    params: SamplingParams
    token_ids: list[int]
    start: int
    stop: int
    is_last: bool


@dataclass
class StepBatch:
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillWork] = field(default_factory=list)


@dataclass
class Tokens:
    """What one row produced: its new tokens in order, each one's source ("draft" | "target") and, when
    its request asked, logprobs; spec: (accepted, drafted) of the speculative step that made them (None
    for an autoregressive step or a prefill's first token)."""

    token_ids: list[int]
    sources: list[str]
    logprobs: list[TokenLogprob] | None = None
    spec: tuple[int, int] | None = None


@dataclass
class StepResult:
    """A step's outcome on the host. decode[i] belongs to batch.decode[i]; prefill[i] to batch.prefill[i]
    (None for a chunk that does not end its prefill). Times in seconds, one-time graph captures left out:
    step_s the decoding step, draft_s / verify_s its parts when measured apart (eager speculative steps,
    else 0), prefill_s each chunk's share of the step's prefill. plan: the plan the decoding step ran (plain
    decoding when its drafter had nothing to propose); timed: whether step_s may teach the cost model (False
    for a thread-count probe; catch_up_s is a switch's one-time cost, not the plan's)."""

    decode: list[Tokens] = field(default_factory=list)
    prefill: list[Tokens | None] = field(default_factory=list)
    step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    plan: object | None = None
    timed: bool = False
    catch_up_s: float = 0.0  # of step_s: the draft model catching up on tokens other plans committed
    capture_s: float = 0.0  # the decoding step's one-time graph captures (left out of step_s)
    # its one-time Triton compiles outside graph captures (a draft catch-up's eager prefill; left out of step_s
    # and of catch_up_s: `engine.compile_clock`)
    compile_s: float = 0.0


def logprob_rows(rows: list[DecodeRow], lp: tuple[torch.Tensor, ...]) -> dict[int, tuple[list, list, list]]:
    """The step's `token_logprobs` output on the host, for the rows whose requests asked:
    {slot: (chosen [A], top values [A][20], top ids [A][20])} (only those rows are copied)."""
    slots = [r.slot for r in rows if r.params.logprobs is not None]
    idx = torch.tensor(slots).to(lp[0].device)
    chosen, top_v, top_i = (t.index_select(0, idx).tolist() for t in lp)
    return {b: (chosen[k], top_v[k], top_i[k]) for k, b in enumerate(slots)}
