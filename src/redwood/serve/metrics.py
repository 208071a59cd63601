"""Prometheus metrics of one server, named like vLLM's (prefix `redwood:` where vLLM has `vllm:`), so
dashboards built for vLLM read them with the prefix changed.

Counters (exposed with `_total`): request_success{finished_reason}, prompt_tokens, generation_tokens,
num_preemptions, spec_decode_num_drafts (verification steps), spec_decode_num_draft_tokens,
spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos{position} (0-based draft
position). Histograms: time_to_first_token_seconds (arrival → first token), inter_token_latency_seconds
(one observation per generated token after the first: the gap since the previous step's tokens split
evenly over the tokens that step gave — a speculative step gives several), e2e_request_latency_seconds.
Gauges: num_requests_running, num_requests_waiting, kv_blocks_used, kv_blocks_free, kv_cache_usage_perc
(used / all blocks, 0..1 as vLLM's).

Everything is in a registry of its own, so several servers in one process (tests) do not collide.
Updates come from the engine thread (`on_request`, `on_step`, `on_preemptions`); prometheus-client
is thread-safe.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 (re-exported for the route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# No `…_created` series beside every counter and histogram (as vLLM: they double the output for nothing a
# dashboard reads). (A process-wide switch of prometheus-client.)
prometheus_client.disable_created_metrics()

PREFIX = "redwood:"

# Buckets as vLLM's (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=r)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self._labels = labels
        self.request_success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        for reason in ("stop", "length"):  # (shown at 0 from the start, as vLLM's)
            self.request_success.labels(finished_reason=reason, **labels)
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**labels)
        self.preemptions = counter("num_preemptions", "Requests preempted (KV blocks taken back).").labels(**labels)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verification steps.").labels(**labels)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(**labels)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**labels)
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
        )
        self.spec_plan_steps = counter(
            "spec_decode_plan_steps",
            "Decoding steps of finished requests by the plan that ran them (ar, ngram γ4, draft γ3, …; "
            "--speculative auto chooses per step).",
            ["plan"],
        )
        self.spec_draftless_acceptance = Gauge(
            PREFIX + "spec_decode_draftless_acceptance",
            "Live acceptance of a draft position by the automatic policy's drafters (drafter@temperature "
            "bucket; draftless drafters are scored on every step, chosen or not).",
            ["model_name", "drafter", "position"],
            registry=r,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Latency per generated token after the first.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Requests holding a batch slot.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.blocks_used = gauge("kv_blocks_used", "KV-cache blocks in use.")
        self.blocks_free = gauge("kv_blocks_free", "KV-cache blocks free.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0..1).")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ engine-thread callbacks
    def on_request(self, handle, delta, now: float) -> None:
        """One delta of one request (see EngineLoop): latencies, token counts; the last one also the
        finish reason and the speculation counters of its stats."""
        n = len(delta.token_ids)
        if n:
            if handle.t_first is None:
                self.ttft.observe(now - handle.t_arrival)
                self.prompt_tokens.inc(handle.prompt_len)
                rest = n - 1  # (tokens that came with the first, in the same step, share its latency)
                gap = 0.0
            else:
                rest, gap = n, now - handle.t_last
            for _ in range(rest):
                self.itl.observe(gap / n)
            self.generation_tokens.inc(n)
        if delta.finish_reason is None:
            return
        self.e2e.observe(now - handle.t_arrival)
        reason = {"context": "length"}.get(delta.finish_reason, delta.finish_reason)  # (vLLM's labels)
        if reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason, **self._labels).inc()
        spec = (delta.stats or {}).get("speculative")
        if spec:
            self.spec_drafts.inc(spec["steps"])
            self.spec_draft_tokens.inc(spec["drafted"])
            self.spec_accepted.inc(spec["accepted"])
            # (exact per-position counts: the steps whose draft token at position i was accepted)
            for pos, count in enumerate(spec.get("accepted_by_position") or []):
                self.spec_accepted_per_pos.labels(position=str(pos), **self._labels).inc(count)
            for plan, count in (spec.get("plans") or {}).items():
                self.spec_plan_steps.labels(plan=plan, **self._labels).inc(count)

    def on_preemptions(self, n: int) -> None:
        self.preemptions.inc(n)

    def on_step(self, loop) -> None:
        pool = loop.engine.pool
        self.running.set(loop.num_running)
        self.waiting.set(loop.num_waiting)
        self.blocks_used.set(pool.num_used)
        self.blocks_free.set(pool.num_free)
        self.kv_usage.set(pool.num_used / pool.num_blocks)
        policy = loop.engine.policy
        if policy.auto and loop.engine.num_steps % 16 == 0:  # (a few gauges; refreshed every 16 steps)
            for drafter, rates in policy.acceptance.snapshot().items():
                for pos, rate in enumerate(rates):
                    self.spec_draftless_acceptance.labels(drafter=drafter, position=str(pos), **self._labels).set(rate)
