"""`redwood bench throughput`: a stream of requests through the Engine, autoregressive vs. speculation.

N requests — windows of exactly `prompt_len` tokens cut from long text (`PromptSource`), each asking for
an output length drawn uniformly from [min_new_tokens, max_new_tokens] (EOS ignored) — arrive either all
at t = 0 (rate ``inf``) or as a Poisson process (exponential gaps of mean 1 / rate, seeded). The same
prompts, output lengths and arrival times run through an autoregressive Engine and through a speculative
one over the same loaded models, one measurement per (mode, rate).

The driver (`run_stream`) adds every request whose arrival time has come, runs one `Engine.step()`, and
stamps each delta; when the engine is idle and the next arrival lies ahead it sleeps until then. The
bench clock leaves out one-time CUDA-graph captures and the kernel compiles of eager steps, e.g. a draft
model's catch-up (`Engine.capture_s` growth during a timed run is subtracted from every later timestamp and
reported as `capture_s`); a warm-up through each engine (short requests, every batch bucket the run can
reach) captures them beforehand.

Metrics per (mode, rate), latencies in ms:
- ``tokens_per_s``: output tokens / (last finish − first arrival); ``request_throughput``: requests/s;
- ``ttft``: first token − arrival (queueing and prefill included);
- ``itl``: per-token inter-token latency — the gap between a request's consecutive deltas divided by that
  delta's token count, one sample per token (a speculative step emits several tokens at once);
- ``chunk_itl``: the raw gap between consecutive deltas (vLLM's "ITL" convention, one sample per delta);
- ``tpot``: (e2e − ttft) / (output tokens − 1) per request; ``e2e``: last token − arrival;
- KV blocks in use (max / mean over steps, out of ``kv_blocks_total``), steps, tokens per engine step,
  preemptions; for speculation acceptance rate and mean accepted length (bonus token included).
Percentiles are numpy's linear interpolation. ``comparison`` holds spec / AR ratios per rate.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from redwood.devices import free_memory
from redwood.engine.step_clock import StepClock
from redwood.errors import ConfigError
from redwood.sampling_params import SamplingParams

DEFAULT_MAX_NUM_SEQS = 64  # this bench's default batch slots
WARMUP_PROMPT = 32  # warm-up prompts: at most this many tokens (a prompt's tail)
WARMUP_MAX_NEW = 512
PLOT_FILE = "throughput.png"
LATENCY_KEYS = ("ttft", "itl", "chunk_itl", "tpot", "e2e")


# ------------------------------------------------------------------------------------------- workload
def parse_rates(values: Sequence[str | float]) -> list[float]:
    """Request rates (requests/s) from the command line: positive numbers or ``inf``; ascending (inf last),
    duplicates dropped."""
    rates: list[float] = []
    for v in values:
        try:
            r = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"--request-rate must be a positive number of requests/s or inf, got {v!r}") from None
        if math.isnan(r) or r <= 0:
            raise ConfigError(f"--request-rate must be > 0 (requests/s) or inf, got {v}")
        if r not in rates:
            rates.append(r)
    if not rates:
        raise ConfigError("--request-rate needs at least one rate")
    return sorted(rates)


def rate_label(rate: float) -> str | float:
    """A rate as reports write it: the number, or "inf"."""
    return "inf" if math.isinf(rate) else rate


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of n requests: the first at 0, then exponential gaps of mean 1 / rate (a Poisson
    process, seeded); every request at 0 when the rate is infinite."""
    import numpy as np

    if n < 1:
        raise ConfigError(f"the number of requests must be >= 1, got {n}")
    if not rate > 0:
        raise ConfigError(f"the request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def output_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """n output lengths drawn uniformly from [low, high] (seeded)."""
    import numpy as np

    return np.random.default_rng([seed, 1]).integers(low, high + 1, n).tolist()


def shared_prefix_prompts(windows, n: int, prompt_len: int, shared_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts of prompt_len tokens whose first shared_len tokens are one common window (0: none).

    windows(count, length, seed) → `count` token windows of `length` from the prompt source. The common
    part is drawn with another seed than the tails, so it is not one of them."""
    if shared_len == 0:
        return windows(n, prompt_len, seed)
    common = windows(1, shared_len, seed + 1)[0]
    return [list(common) + list(tail) for tail in windows(n, prompt_len - shared_len, seed)]


def check_workload(
    num_requests: int, prompt_len: int, min_new: int, max_new: int, max_model_len: int | None = None
) -> None:
    """One-line errors for a workload that cannot run (before any model loads)."""
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if prompt_len < 1:
        raise ConfigError(f"--prompt-len must be >= 1, got {prompt_len}")
    if min_new < 1:
        raise ConfigError(f"--min-new-tokens must be >= 1, got {min_new}")
    if min_new > max_new:
        raise ConfigError(f"--min-new-tokens ({min_new}) is more than --max-new-tokens ({max_new})")
    if max_model_len is not None and prompt_len + max_new > max_model_len:
        raise ConfigError(
            f"--prompt-len {prompt_len} + --max-new-tokens {max_new} = {prompt_len + max_new} tokens "
            f"is more than --max-model-len {max_model_len}"
        )


def check_context(contexts: Sequence[tuple[str, int]], prompt_len: int, max_new: int) -> None:
    """prompt + the longest output must fit each model's context ((what, context) pairs)."""
    for what, context in contexts:
        if prompt_len + max_new > context:
            raise ConfigError(
                f"--prompt-len {prompt_len} + --max-new-tokens {max_new} = {prompt_len + max_new} "
                f"tokens is more than {what}'s context of {context} tokens"
            )


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def n(self) -> int:
        return len(self.prompts)


def make_workload(
    prompts: list[list[int]],
    lengths: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Workload:
    """Request i asks for exactly lengths[i] tokens (EOS ignored), sampling with seed + i when seeded."""
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=int(m),
            ignore_eos=True,
            seed=None if seed is None else seed + i,
        )
        for i, m in enumerate(lengths)
    ]
    return Workload([list(p) for p in prompts], params)


# --------------------------------------------------------------------------------------------- driving
@dataclass
class RequestRecord:
    """One request's timeline on the bench clock (seconds)."""

    arrival: float
    requested: int
    first: float | None = None
    finish: float | None = None
    times: list[float] = field(default_factory=list)  # each delta with tokens
    counts: list[int] = field(default_factory=list)  # its token count
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict | None = None
    preemptions: int = 0


def _sync(engine) -> None:
    device = getattr(getattr(engine, "model", None), "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_stream(
    engine,
    workload: Workload,
    arrivals: Sequence[float],
    *,
    prefix: str = "r",
    progress: Callable[[int], None] | None = None,
    sleep=time.sleep,
) -> dict[str, Any]:
    """Drive `engine` through the workload with the given arrival times; → records and step samples.

    The clock starts at the first arrival and leaves out CUDA-graph captures done during the run.
    """
    n = workload.n
    if len(arrivals) != n:
        raise ConfigError(f"{len(arrivals)} arrival times for {n} requests")
    order = sorted(range(n), key=lambda i: arrivals[i])
    recs = [RequestRecord(float(arrivals[i]), workload.params[i].max_new_tokens) for i in range(n)]
    ids: dict[str, int] = {}
    live: dict[str, int] = {}
    scheduler = getattr(engine, "scheduler", None)
    blocks: list[int] = []
    steps = done = 0
    nxt = 0
    _sync(engine)
    capture0 = engine.capture_s
    step_clock = getattr(engine, "clock", None)  # (the engine's step phases: `engine.step_clock`)
    phases0 = step_clock.snapshot() if step_clock is not None else None
    t0 = time.perf_counter() - min(arrivals)

    def clock() -> float:
        return time.perf_counter() - t0 - (engine.capture_s - capture0)

    while done < n:
        now = clock()
        while nxt < n and arrivals[order[nxt]] <= now:
            i = order[nxt]
            rid = engine.add_request(workload.prompts[i], workload.params[i], request_id=f"{prefix}{i}")
            ids[rid] = live[rid] = i
            nxt += 1
        if not engine.has_unfinished():
            if nxt >= n:
                raise RuntimeError(f"the engine holds no request but only {done} of {n} finished")
            sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        deltas = engine.step()
        t = clock()
        steps += 1
        blocks.append(engine.pool.num_used)
        for d in deltas:
            rec = recs[ids[d.request_id]]
            if d.token_ids:
                rec.times.append(t)
                rec.counts.append(len(d.token_ids))
                rec.token_ids += d.token_ids
                if rec.first is None:
                    rec.first = t
            if d.finish_reason is not None:
                rec.finish, rec.finish_reason, rec.stats = t, d.finish_reason, d.stats
                live.pop(d.request_id, None)
                done += 1
                if progress is not None:
                    progress(1)
        if scheduler is not None:
            for rid, i in live.items():
                seq = scheduler.get(rid)
                if seq is not None:
                    recs[i].preemptions = getattr(seq, "num_preemptions", 0)
    _sync(engine)
    return {
        "records": recs,
        "steps": steps,
        "blocks": blocks,
        "capture_s": engine.capture_s - capture0,
        "phases": None if step_clock is None else StepClock.since(phases0, step_clock.snapshot()),
        "blocks_used_at_end": engine.pool.num_used,
        "kv_blocks_total": engine.pool.num_blocks,
    }


def warm_up(engine, workload: Workload, prefix: str = "warm") -> None:
    """Untimed requests through `engine` that meet every kernel and graph the timed runs will: first one
    request as long as the longest prompt (its tokens reversed, so it never shares a cached prefix with a
    timed prompt) — the long prefill chunks and long-context decoding steps compile their kernels here,
    not inside the first timed run (measured: AR, timed first, paid seconds of them in its TTFT at
    32K) — then short requests (prompt tails) joining one per step, as many as the timed runs can have
    running, so every batch bucket's CUDA graphs get captured, each long enough to stay until the last
    has joined."""
    p = workload.params[0]
    depth = engine.tree.max_depth if getattr(engine, "tree", None) is not None else 1

    def params(new: int) -> SamplingParams:
        return SamplingParams(
            temperature=p.temperature, top_p=p.top_p, max_new_tokens=new, ignore_eos=True, seed=p.seed
        )

    longest = max(range(workload.n), key=lambda i: len(workload.prompts[i]))
    full = workload.prompts[longest][::-1]
    engine.add_request(
        full, params(max(1, min(2 * depth + 2, engine.max_model_len - len(full)))), request_id=f"{prefix}-full"
    )
    while engine.has_unfinished():
        engine.step()
    k = min(workload.n, engine.max_num_seqs)
    length = min(WARMUP_PROMPT, len(workload.prompts[0]))
    new = max(1, min(depth * k + 2, WARMUP_MAX_NEW, engine.max_model_len - length))
    for i in range(k):
        engine.add_request(workload.prompts[i][-length:], params(new), request_id=f"{prefix}{i}")
        engine.step()
    while engine.has_unfinished():
        engine.step()


# --------------------------------------------------------------------------------------------- metrics
def percentile(values: Sequence[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if len(values) else None


def latency_samples(recs: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Latency samples (seconds) of finished requests: ttft, itl (per token), chunk_itl, tpot, e2e."""
    out: dict[str, list[float]] = {k: [] for k in LATENCY_KEYS}
    for r in recs:
        if r.first is None or r.finish is None:
            continue
        out["ttft"].append(r.first - r.arrival)
        out["e2e"].append(r.times[-1] - r.arrival)
        for k in range(1, len(r.times)):
            gap = r.times[k] - r.times[k - 1]
            out["chunk_itl"].append(gap)
            out["itl"] += [gap / r.counts[k]] * r.counts[k]
        tokens = len(r.token_ids)
        if tokens > 1:
            out["tpot"].append((r.times[-1] - r.first) / (tokens - 1))
    return out


def summarize(stream: dict[str, Any], method: str, rate: float) -> dict[str, Any]:
    """One (mode, rate) run's record from `run_stream`'s output."""
    recs: list[RequestRecord] = stream["records"]
    tokens = sum(len(r.token_ids) for r in recs)
    start = min(r.arrival for r in recs)
    end = max(r.finish for r in recs if r.finish is not None)
    duration = end - start
    run: dict[str, Any] = {
        "method": method,
        "request_rate": rate_label(rate),
        "num_requests": len(recs),
        "duration_s": duration,
        "output_tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(recs) / duration if duration > 0 else 0.0,
    }
    for key, values in latency_samples(recs).items():
        ms = [1e3 * v for v in values]
        run[f"{key}_ms_p50"], run[f"{key}_ms_p99"] = percentile(ms, 50), percentile(ms, 99)
        run[f"{key}_ms_mean"] = _mean(ms)
    blocks = stream["blocks"]
    run.update(
        steps=stream["steps"],
        tokens_per_engine_step=tokens / stream["steps"] if stream["steps"] else 0.0,
        kv_blocks_max=max(blocks, default=0),
        kv_blocks_mean=_mean(blocks) or 0.0,
        kv_blocks_total=stream["kv_blocks_total"],
        kv_blocks_used_at_end=stream["blocks_used_at_end"],
        preemptions=sum(r.preemptions for r in recs),
        capture_s=stream["capture_s"],
        decode_step_phases=stream.get("phases"),
        all_completed=all(r.finish_reason is not None and len(r.token_ids) == r.requested for r in recs),
    )
    stats = [r.stats for r in recs if r.stats and r.stats.get("speculative")]
    if stats:
        from redwood.bench.speculative import aggregate_spec

        agg = aggregate_spec(stats)
        run.update(
            acceptance_rate=agg["acceptance_rate"],
            mean_accepted_length=agg["mean_accepted_length"],
            tokens_per_step=agg["mean_accepted_length"],
            acceptance_by_position=agg["acceptance_by_position"],
            spec_steps=agg["steps"],
        )
    run["per_request"] = [
        {
            "id": i,
            "arrival_s": r.arrival,
            "requested_tokens": r.requested,
            "output_tokens": len(r.token_ids),
            "finish_reason": r.finish_reason,
            "ttft_ms": None if r.first is None else 1e3 * (r.first - r.arrival),
            "e2e_ms": None if r.finish is None else 1e3 * (r.times[-1] - r.arrival),
            "preemptions": r.preemptions,
            **_row_speculation(r.stats),
        }
        for i, r in enumerate(recs)
    ]
    return run


def _row_speculation(stats: dict | None) -> dict[str, Any]:
    """A request's own target steps and tokens per step (bonus included) under speculation — which rows the
    run waited on (`_tail_line`); nothing for plain decoding."""
    spec = (stats or {}).get("speculative")
    if not spec or not spec.get("steps"):
        return {}
    return {"spec_steps": spec["steps"], "tokens_per_step": spec["mean_accepted_length"]}


def _tail_line(run: dict[str, Any]) -> str | None:
    """The speculative run's tail: the last tenth of its requests to finish (at least one), their tokens per
    step against the others', and how long the run went on after the others were done — with every row in
    every step, a row finishes late by accepting less, and the run's clock waits for it."""
    rows = [p for p in run.get("per_request", []) if p.get("tokens_per_step") and p.get("e2e_ms") is not None]
    if len(rows) < 10:
        return None

    def end(p):
        return p["arrival_s"] + p["e2e_ms"] / 1e3

    def mean(ps):
        return sum(p["tokens_per_step"] for p in ps) / len(ps)

    rows.sort(key=end)
    k = math.ceil(len(rows) / 10)
    tail, rest = rows[-k:], rows[:-k]
    return (
        f"tail @ {_rate_text(run['request_rate'])} req/s: the last {k} of {len(rows)} requests to finish made "
        f"{mean(tail):.2f} tokens a step (the others {mean(rest):.2f}); the run went on {end(tail[-1]) - end(rest[-1]):.1f} s "
        "after the others had finished"
    )


RATIO_KEYS = ("tokens_per_s", "request_throughput") + tuple(f"{k}_ms_{p}" for k in LATENCY_KEYS for p in ("p50", "p99"))


def compare(ar: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """spec / AR for throughput and each latency percentile at one rate (> 1: spec higher)."""
    out: dict[str, Any] = {"request_rate": ar["request_rate"]}
    for k in RATIO_KEYS:
        a, s = ar.get(k), spec.get(k)
        out[f"{k}_ratio"] = s / a if a and s is not None else None
    out["identical_to_ar"] = spec.get("identical_to_ar")
    # the throughput ratio had the one-time graph captures of the timed runs been on their clocks (a server pays
    # them once; a run as short as this bench's pays them here)
    a_s, s_s = ar["duration_s"] + ar.get("capture_s", 0.0), spec["duration_s"] + spec.get("capture_s", 0.0)
    out["tokens_per_s_ratio_with_captures"] = (
        (spec["output_tokens"] / s_s) / (ar["output_tokens"] / a_s)
        if a_s > 0 and s_s > 0 and ar["output_tokens"]
        else None
    )
    return out


# --------------------------------------------------------------------------------------------- the bench
def run_bench(
    target,
    tokenizer,
    workload: Workload,
    rates: Sequence[float],
    *,
    drafter=None,
    tree=None,
    verifier: str = "auto",
    auto_drafters: list | None = None,
    spec: bool = True,
    engine_args: dict | None = None,
    model_name: str = "model",
    cuda_graphs: bool | None = None,
    workload_seed: int = 0,
    progress: bool = False,
    repeats: int = 1,
    base=None,
    fixed_tree=None,
) -> dict[str, Any]:
    """Measure AR (and speculation with `drafter` over `tree`, unless spec is False) at every rate.

    target / tokenizer / drafter / tree: already loaded (e.g. an `LLM`'s); one Engine is built per mode
    (`Engine.build`, one at a time), warmed up, and serves every rate — a fresh one per rate when prefix
    caching is on, so one rate's cached prompts do not serve the next. auto_drafters: speculation under the
    automatic policy over these drafters (`LoadedModels.auto_drafters`) instead of `drafter` over `tree`.
    repeats: the modes measured this many times, interleaved (AR, spec, AR, spec, …: a drift of the machine's
    speed hits both); each (mode, rate) reports its median run by tokens/s, with every repeat's tokens/s
    (`tokens_per_s_repeats`) and, for speculation, every repeat's speedup over the AR run just before it.
    base: an `Engine` over the loaded models (an `LLM`'s) — each mode's engine is then `base.rebuild(...)` (AR:
    its drafters left unused), which closes the one before on every rank: the way this runs under tensor
    parallelism; target / drafter / tree / auto_drafters are then read from it.
    fixed_tree: with auto_drafters, also measure `drafter` over this tree as a fixed plan (method "fixed", after AR
    in each repeat, before the automatic policy; `comparison_fixed` its ratios to AR) — one process and one AR run
    for both comparisons. Not with `base`.
    """
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1 (got {repeats})")
    from redwood.bench.divergence import divergence_logits, first_divergence, is_numerical_tie
    from redwood.engine.engine import Engine

    if spec and drafter is None:
        raise ConfigError("speculation needs a drafter (or spec=False for autoregressive only)")
    if fixed_tree is not None and (not spec or not auto_drafters or base is not None):
        raise ConfigError("a fixed plan is compared beside the automatic policy only, on one device")
    engine_args = dict(engine_args or {})
    engine_args.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    if "max_model_len" not in engine_args:
        longest = max(len(p) + q.max_new_tokens for p, q in zip(workload.prompts, workload.params))
        engine_args["max_model_len"] = min(longest, target.config.max_position_embeddings)
    fresh_per_rate = bool(engine_args.get("enable_prefix_caching"))
    greedy = all(p.greedy for p in workload.params)
    arrivals = {r: poisson_arrivals(workload.n, r, workload_seed) for r in rates}
    spec_kw = {"drafter": drafter, "tree": tree} if not auto_drafters else {"auto_drafters": auto_drafters}
    modes = [("ar", {})]
    if fixed_tree is not None:
        modes.append(("fixed", {"drafter": drafter, "tree": fixed_tree, "verifier": verifier}))
    modes += [("spec", {**spec_kw, "verifier": verifier})] if spec else []
    trials: dict[tuple[str, float], list[dict[str, Any]]] = {}
    tokens: dict[tuple[str, float], list[list[int]]] = {}
    info: dict[str, Any] = {}
    for rep, (mode, kw) in ((rep, m) for rep in range(repeats) for m in modes):
        engine = None
        for j, rate in enumerate(rates):
            if engine is None or fresh_per_rate:
                if base is not None:  # (closes the engine before it, on every rank, then builds)
                    engine = base = base.rebuild(speculate=mode == "spec", cuda_graphs=cuda_graphs, **engine_args)
                else:
                    engine = None
                    free_memory(target.device)
                    engine = Engine.build(
                        target, tokenizer, model_name=model_name, cuda_graphs=cuda_graphs, **kw, **engine_args
                    )
                warm_up(engine, workload)
                info.setdefault(
                    "engine",
                    {
                        "max_num_seqs": engine.max_num_seqs,
                        "max_model_len": engine.max_model_len,
                        "block_size": engine.block_size,
                        "kv_blocks": engine.pool.num_blocks,
                        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                        "prefill_first": engine.scheduler.prefill_first,
                        "cuda_graphs": engine.use_graphs,
                    },
                )
                if mode == "spec":
                    info["draft"], info["tree_size"] = engine.draft_name, engine.tree.size
                    info["gamma"] = engine.tree.max_depth - 1  # (under the auto policy: the longest it may plan)
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(
                    total=workload.n,
                    desc=f"{mode} @ {rate_label(rate)} req/s" + (f" ({rep + 1}/{repeats})" if repeats > 1 else ""),
                    unit="req",
                    file=sys.stderr,
                    leave=False,
                )
            try:
                stream = run_stream(
                    engine, workload, arrivals[rate], prefix=f"{mode}{j}-", progress=None if bar is None else bar.update
                )
            finally:
                if bar is not None:
                    bar.close()
            run = summarize(stream, mode, rate)
            tokens[mode, rate] = [r.token_ids for r in stream["records"]]  # (this repeat's: AR's ran just before)
            if mode != "ar":
                same = [a == b for a, b in zip(tokens["ar", rate], tokens[mode, rate])]
                run["identical_to_ar"] = all(same) if greedy else None
                run["requests_identical_to_ar"] = sum(same)
                parting = first_divergence(tokens["ar", rate], tokens[mode, rate]) if greedy else None
                if parting is not None:  # where, and the target's top-2 gap there (a tie in bf16, or a bug)
                    i = parting["row"]
                    parting.update(
                        divergence_logits(
                            engine.prompt_logits,
                            workload.prompts[i],
                            tokens["ar", rate][i],
                            tokens[mode, rate][i],
                            parting["position"],
                        )
                    )
                    parting["numerical_tie"] = is_numerical_tie(parting, target.dtype)
                    run["first_divergence"] = parting
                ar_tps = trials["ar", rate][-1]["tokens_per_s"]  # (this repeat's AR run)
                run["speedup"] = run["tokens_per_s"] / ar_tps if ar_tps > 0 else None
                if mode == "fixed":
                    run["plan"] = f"{engine.draft_name}, chain:{fixed_tree.size - 1}"
                if engine.policy.auto:  # its plans so far (this engine's rates up to this one, warm-up included)
                    run["policy"] = engine.policy.report()
            trials.setdefault((mode, rate), []).append(run)
        if base is None:
            del engine
            free_memory(target.device)
    runs = {key: _median_run(group) for key, group in trials.items()}
    if repeats > 1 and spec:
        for rate in rates:  # the medians' ratio (each repeat's own: speedup_repeats)
            ar_tps = runs["ar", rate]["tokens_per_s"]
            for m, _ in modes[1:]:
                runs[m, rate]["speedup"] = runs[m, rate]["tokens_per_s"] / ar_tps if ar_tps > 0 else None
    ordered = [runs[m, r] for r in rates for m, _ in modes]
    comparison = [compare(runs["ar", r], runs["spec", r]) for r in rates] if spec else []
    fixed = [compare(runs["ar", r], runs["fixed", r]) for r in rates] if fixed_tree is not None else []
    identical = [c["identical_to_ar"] for c in comparison + fixed if c["identical_to_ar"] is not None]
    extra = {"comparison_fixed": fixed} if fixed else {}
    return {
        "kind": "throughput",
        "model": model_name,
        "request_rates": [rate_label(r) for r in rates],
        "greedy": greedy,
        **info,
        "runs": ordered,
        "comparison": comparison,
        **extra,
        "all_identical": all(identical) if identical else None,
        "capture_s_in_timed_runs": sum(r["capture_s"] for r in ordered),
    }


def _median_run(group: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mode, rate)'s report over its repeats: the run of median tokens/s (the lower of the middle two for
    an even count), with every repeat's tokens/s and speedup; greedy output identical only if in every one."""
    if len(group) == 1:
        return group[0]
    run = dict(sorted(group, key=lambda x: x["tokens_per_s"])[(len(group) - 1) // 2])
    run["tokens_per_s_repeats"] = [x["tokens_per_s"] for x in group]
    if "speedup" in run:
        run["speedup_repeats"] = [x["speedup"] for x in group]
        if any(x.get("identical_to_ar") is False for x in group):
            worst = next(x for x in group if x.get("identical_to_ar") is False)
            run["identical_to_ar"] = False
            run["requests_identical_to_ar"] = worst["requests_identical_to_ar"]
            if "first_divergence" in worst:
                run["first_divergence"] = worst["first_divergence"]
    return run


# ----------------------------------------------------------------------------------------------- output
def _rate_text(rate: str | float) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def _ms(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _pair(run: dict | None, key: str) -> str:
    return "–" if run is None else f"{_ms(run[f'{key}_ms_p50'])}/{_ms(run[f'{key}_ms_p99'])}"


def format_result(r: dict[str, Any]) -> str:
    """The short table: per rate, AR and spec tokens/s, the ratio, TTFT and per-token ITL p50/p99."""
    s = r["settings"]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-p {s['top_p']}"
    head = f"throughput: {r['model']}"
    if r.get("draft"):
        head += f"; spec: {r['draft']}, {r.get('tree')}, verifier {r.get('verifier')}"
    e = r.get("engine", {})
    lines = [
        head,
        f"{s['num_requests']} requests of {s['prompt_len']} prompt tokens"
        + (f" (the first {s['shared_prefix_len']} shared)" if s.get("shared_prefix_len") else "")
        + f", {s['min_new_tokens']}-"
        f"{s['max_new_tokens']} new tokens each ({sampling}, EOS ignored); prompts from {s['prompts']}; "
        f"{s['dtype']} on {s['device']}; {e.get('max_num_seqs')} slots, {e.get('kv_blocks')} KV blocks "
        f"of {e.get('block_size')}"
        + (f", {e['max_num_batched_tokens']} prefill tokens a step" if "max_num_batched_tokens" in e else "")
        + ("; prefill first" if e.get("prefill_first") else ""),
    ]
    spec = bool(r["comparison"])
    by = {(x["method"], str(x["request_rate"])): x for x in r["runs"]}
    cols = f"{'rate':>6} {'AR tok/s':>9}"
    if spec:
        cols += f" {'spec tok/s':>10} {'ratio':>6}"
    cols += f"  {'TTFT p50/p99 ms AR':>18}"
    if spec:
        cols += f" {'spec':>11}"
    cols += f"  {'ITL p50/p99 ms AR':>17}"
    if spec:
        cols += f" {'spec':>11} {'acc len':>7} {'same':>4}"
    lines.append(cols)
    for rate in r["request_rates"]:
        ar, sp = by.get(("ar", str(rate))), by.get(("spec", str(rate)))
        line = f"{_rate_text(rate):>6} {ar['tokens_per_s']:>9.1f}"
        if spec:
            ratio = sp["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
            same = {True: "yes", False: "NO", None: "n/a"}[sp.get("identical_to_ar")]
            line += f" {sp['tokens_per_s']:>10.1f} {'–' if ratio is None else f'{ratio:.2f}x':>6}"
        line += f"  {_pair(ar, 'ttft'):>18}"
        if spec:
            line += f" {_pair(sp, 'ttft'):>11}"
        line += f"  {_pair(ar, 'itl'):>17}"
        if spec:
            line += f" {_pair(sp, 'itl'):>11} {sp.get('mean_accepted_length', 0.0):>7.2f} {same:>4}"
        lines.append(line)
    for rate in r["request_rates"] if r.get("comparison_fixed") else []:
        ar, fx, sp = (by.get((m, str(rate))) for m in ("ar", "fixed", "spec"))
        same = {True: "yes", False: "NO", None: "n/a"}[fx.get("identical_to_ar")]
        lines.append(
            f"fixed plan @ {_rate_text(rate)} req/s ({fx.get('plan')}): {fx['tokens_per_s']:.1f} tok/s, "
            f"{fx['tokens_per_s'] / ar['tokens_per_s']:.3f}x AR; spec / fixed {sp['tokens_per_s'] / fx['tokens_per_s']:.3f}x; "
            f"ITL p50/p99 {_pair(fx, 'itl')} ms; acc len {fx.get('mean_accepted_length', 0.0):.2f}; same {same}"
        )
    lines.append(
        "tok/s = output tokens / (last finish − first arrival); ITL per token (a delta's gap over its "
        "tokens); acc len = tokens per target step, bonus included; same = greedy spec output "
        "identical to AR"
    )
    for x in r["runs"]:
        if "tokens_per_s_repeats" in x:  # (--repeats: the medians above; each repeat's here)
            each = ", ".join(f"{v:.1f}" for v in x["tokens_per_s_repeats"])
            line = f"repeats @ {_rate_text(x['request_rate'])} req/s, {x['method']}: tok/s {each}"
            if "speedup_repeats" in x:
                line += " (speedup " + ", ".join(f"{v:.2f}x" for v in x["speedup_repeats"] if v is not None) + ")"
            lines.append(line)
    if r.get("capture_s_in_timed_runs", 0) > 0:
        counted = [
            f"{c['tokens_per_s_ratio_with_captures']:.2f}x @ {_rate_text(c['request_rate'])} req/s"
            for c in r.get("comparison", [])
            if c.get("tokens_per_s_ratio_with_captures") is not None
        ]
        lines.append(
            f"note: {r['capture_s_in_timed_runs']:.2f} s of CUDA-graph capture (and kernel compiles) during the "
            "timed runs was left out of their clocks"
            + (f" (counted, spec / AR: {', '.join(counted)})" if counted else "")
        )
    for x in r["runs"]:
        phases = x.get("decode_step_phases")
        if phases and phases["steps"]:
            ms = phases["ms"]
            parts = ", ".join(f"{p} {v:.2f}" for p, v in ms.items() if p != "forward" and v >= 0.005)
            lines.append(
                f"decode steps @ {_rate_text(x['request_rate'])} req/s, {x['method']}: {phases['steps']} without "
                f"prefill; ms a step: forward {ms['forward']:.2f}, host {phases['host_ms']:.2f} ({parts})"
            )
    for x in r["runs"]:
        tail = _tail_line(x) if x["method"] == "spec" else None
        if tail:
            lines.append(tail)
    preempted = sum(x["preemptions"] for x in r["runs"])
    if preempted:
        lines.append(f"note: {preempted} preemptions (KV cache full; the requests were recomputed)")
    if r.get("all_identical") is False:
        lines.extend(_parting_lines(r))
    return "\n".join(lines)


def _parting_lines(r: dict[str, Any]) -> list[str]:
    """Greedy outputs that differ: a note where every first parting is a tie of the dtype's rounding (bf16 /
    fp16 verify and decode forwards round differently), else the warning — a bug."""
    import torch

    from redwood.bench.divergence import describe

    dtype = getattr(torch, r["settings"]["dtype"], torch.float32)
    runs = [x for x in r["runs"] if x.get("identical_to_ar") is False]
    partings = [(x, x.get("first_divergence") or {}) for x in runs]
    ties = all(d.get("numerical_tie") for _, d in partings)
    lines = []
    if ties:
        lines.append(
            f"note: greedy outputs differ from AR's at a near-tie of {r['settings']['dtype']} rounding (a verify and "
            "a one-token decode round differently there; float32 outputs are identical):"
        )
    else:
        lines.append("WARNING: greedy speculative output differs from autoregressive output (must be identical)")
    for x, d in partings:
        where = describe(d, dtype) if d else "no parting found"
        lines.append(
            f"  @ {_rate_text(x['request_rate'])} req/s: {x['num_requests'] - x['requests_identical_to_ar']} of "
            f"{x['num_requests']} requests differ; {where}"
        )
    return lines


def write_plot(path: str | Path, r: dict[str, Any]) -> Path:
    """throughput.png: output tokens/s vs request rate, and TTFT / ITL p50 & p99 vs request rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = r["request_rates"]
    xs = list(range(len(rates)))
    labels = [_rate_text(x) for x in rates]
    fig = Figure(figsize=(12, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = {"ar": "tab:blue", "fixed": "tab:green", "spec": "tab:orange"}
    names = {"ar": "AR", "fixed": "fixed plan", "spec": "spec"}
    for method in ("ar", "fixed", "spec"):
        rows = {str(x["request_rate"]): x for x in r["runs"] if x["method"] == method}
        if not rows:
            continue
        pts = [(i, rows[str(rate)]) for i, rate in zip(xs, rates) if str(rate) in rows]
        ax1.plot(
            [i for i, _ in pts],
            [x["tokens_per_s"] for _, x in pts],
            marker="o",
            color=colors[method],
            label=names[method],
        )
        for key, marker in (("ttft", "o"), ("itl", "s")):
            for p, style in (("p50", "-"), ("p99", "--")):
                ys = [x[f"{key}_ms_{p}"] for _, x in pts]
                ax2.plot(
                    [i for i, _ in pts],
                    [float("nan") if y is None else y for y in ys],
                    marker=marker,
                    linestyle=style,
                    color=colors[method],
                    label=f"{names[method]} {key.upper()} {p}",
                )
    for ax in (ax1, ax2):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if len(xs) == 1:
        for ax in (ax1, ax2):
            ax.set_xlim(-0.5, 0.5)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("Output throughput vs request rate")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("latency (ms)")
    ax2.set_yscale("log")
    ax2.set_title("TTFT and per-token ITL (p50 solid, p99 dashed)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def to_report(r: dict[str, Any], cli: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `write_report` form (schema redwood.bench/1) of a result."""
    models = {"target": r["model"], "dtype": r["settings"]["dtype"]}
    if r.get("draft"):
        models["draft"] = r["draft"]
    aggregate: dict[str, Any] = {}
    if r["comparison"]:
        best = max(r["comparison"], key=lambda c: c["tokens_per_s_ratio"] or 0.0)
        aggregate.update(best_tokens_per_s_ratio=best["tokens_per_s_ratio"], at_request_rate=best["request_rate"])
    if r.get("all_identical") is not None:
        aggregate["greedy_identical_to_ar"] = r["all_identical"]
    runs = [{**x, "max_new_tokens": r["settings"]["max_new_tokens"]} for x in r["runs"]]
    return {
        "kind": "throughput",
        "models": models,
        "config": {
            **r["settings"],
            "engine": r.get("engine"),
            "tree": r.get("tree"),
            "verifier": r.get("verifier"),
            "cli": cli or {},
        },
        "runs": runs,
        "comparison": r["comparison"],
        **({"comparison_fixed": r["comparison_fixed"]} if r.get("comparison_fixed") else {}),
        "aggregate": aggregate,
        "capture_s_in_timed_runs": r.get("capture_s_in_timed_runs"),
    }


def add_plot_to_report(report_path: str | Path, name: str) -> None:
    """List `name` among report.json's plots (write_report lists only the plots it draws itself)."""
    import json

    path = Path(report_path)
    data = json.loads(path.read_text())
    data["plots"] = [name] + [p for p in data.get("plots", []) if p != name]
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
