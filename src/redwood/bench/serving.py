"""`redwood bench serve`: an async load generator for any OpenAI-compatible server (redwood's, vLLM's, llama.cpp's).

N requests — text prompts from the datasets of `redwood bench throughput` (windows of exactly
`prompt_len` tokens of long text, cut with a tokenizer and decoded; document prefixes; or chat questions as
they are) asking for `max_tokens` each (or a length uniform in [min_tokens, max_tokens]) — are sent to
``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (one user message), streaming with
``stream_options.include_usage``. They arrive as a Poisson process at each request rate (exponential gaps
of mean 1 / rate, seeded; ``inf``: all at t = 0), optionally never more than ``max_concurrency`` in flight
(rate inf + a cap = a closed loop of that many clients). One measurement per (rate, concurrency).

Per request, on the client's clock from the moment it is sent: the time of every SSE chunk that carries
content, the server's token counts from the final usage chunk, errors (HTTP status + the server's message,
an ``error`` object inside the stream, a dropped connection, a read timeout).

Metrics per run, latencies in ms, over the requests that succeeded:
- ``tokens_per_s``: output tokens (usage ``completion_tokens``) / (last finish − first send);
  ``request_throughput``: successful requests / the same duration;
- ``ttft``: first content chunk − send; ``e2e``: end of the stream − send;
- ``chunk_itl``: the gap between consecutive content chunks (vLLM's "ITL", one sample per chunk);
- ``itl``: per-token inter-token latency — a chunk's gap spread over the tokens it carries, one sample per
  token (a speculating server streams several tokens per chunk). A chunk's token count comes from the
  server when it says (``logprobs`` tokens, ``token_ids``); otherwise the usage total is apportioned over
  the chunks in proportion to their tokenizer counts (their characters without a tokenizer);
  ``token_counts`` in the run says which;
- ``tpot``: (last content chunk − first) / (output tokens − 1), as vLLM's benchmark_serving;
- errors: count, by status (``"400"``, ``"503"``, ``"stream"``, ``"connection"``, ``"timeout"``), the first
  few messages; ``max_in_flight``: the most requests the client had open at once.
When the server's ``/metrics`` has vLLM-named speculation counters (``…spec_decode_num_drafts``,
``…num_draft_tokens``, ``…num_accepted_tokens``), their growth over a run gives its acceptance rate and mean
accepted length (bonus token included). Percentiles are numpy's linear interpolation.

`write_plot` draws TTFT and per-token ITL (p50, p99) against output tokens/s, one line per label; given
several reports (`load_reports`) it draws them on one figure (e.g. speculation vs. none).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from redwood.bench.throughput import percentile, poisson_arrivals, rate_label
from redwood.errors import ConfigError, RedwoodError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PLOT_FILE = "serve.png"
LATENCY_KEYS = ("ttft", "itl", "chunk_itl", "tpot", "e2e")
ERROR_SAMPLES = 5  # messages kept per run
DEFAULT_TIMEOUT_S = 300.0


class ServerError(RedwoodError):
    """A server that cannot be reached or refuses the benchmark's setup requests (models list, auth)."""


# ------------------------------------------------------------------------------------------- settings
def normalize_base_url(url: str) -> str:
    """``http[s]://host[:port][/prefix]`` without a trailing ``/`` or ``/v1`` (the endpoints add it)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--base-url must be an http:// or https:// URL (e.g. http://127.0.0.1:8000), got {url!r}")
    base = url.strip().rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def parse_endpoint(value: str) -> str:
    """``completions`` / ``chat`` (or their paths) → the path under the base URL."""
    for name, path in ENDPOINTS.items():
        if value in (name, path, path.lstrip("/"), "chat/completions" if name == "chat" else name):
            return path
    raise ConfigError(f"--endpoint must be completions or chat ({' or '.join(ENDPOINTS.values())}), got {value!r}")


def parse_concurrency(values: Sequence[int] | None) -> list[int | None]:
    """--max-concurrency values (each >= 1, ascending, duplicates dropped), or [None] for no cap."""
    if not values:
        return [None]
    out: list[int] = []
    for v in values:
        if v < 1:
            raise ConfigError(f"--max-concurrency must be >= 1 (requests in flight), got {v}")
        if v not in out:
            out.append(v)
    return sorted(out)


@dataclass
class Settings:
    """What every request of a benchmark shares."""

    base_url: str
    endpoint: str  # a path from ENDPOINTS
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # request i samples with seed + i
    ignore_eos: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def chat(self) -> bool:
        return self.endpoint == ENDPOINTS["chat"]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def check_settings(
    num_requests: int,
    max_tokens: int,
    min_tokens: int | None,
    temperature: float,
    top_p: float,
    timeout_s: float,
    warmup: int,
) -> None:
    """One-line errors for flags that cannot make a benchmark (before any request is sent)."""
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    if min_tokens is not None and not 1 <= min_tokens <= max_tokens:
        raise ConfigError(f"--min-tokens must be between 1 and --max-tokens ({max_tokens}), got {min_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"--timeout must be > 0 seconds, got {timeout_s}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")


# -------------------------------------------------------------------------------------------- prompts
def load_tokenizer(spec: str):
    """A tokenizer (to cut prompts of an exact token length) from a zoo name, HF folder or .gguf file."""
    from redwood.errors import ModelLoadError
    from redwood.loading import resolve_model_path

    path = resolve_model_path(spec)
    if path.is_dir() and not any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"--tokenizer {spec}: {path} has no tokenizer files and not exactly one .gguf file")
        path = ggufs[0]
    if path.is_dir():
        from redwood.loading.hf import load_hf_tokenizer

        tok = load_hf_tokenizer(path)
        if tok is None:
            raise ModelLoadError(f"--tokenizer {spec}: no tokenizer in {path}")
        return tok
    from redwood.loading.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(path)


def local_tokenizer_spec(model: str) -> str | None:
    """`model` when it names a tokenizer available without downloading (an existing path or a pulled zoo
    model) — a server's model id often is the path or zoo name it was started with."""
    from redwood.models import registry

    if model in registry.known_models():
        return model if registry.is_pulled(model) else None
    return model if Path(model).expanduser().exists() else None


def needs_tokenizer(source) -> bool:
    """Token-exact prompts (long-text windows, document prefixes) need a tokenizer; chat questions don't."""
    if source.prompts_file:
        return True
    from redwood.data.recipes import dataset_kind

    return dataset_kind(source.dataset) != "chat"


def text_prompts(source, count: int, prompt_len: int, seed: int = 0, tokenizer=None, shared_len: int = 0) -> list[str]:
    """`count` prompt texts from a `PromptSource`: windows of exactly `prompt_len` tokens of the long text (as
    `bench throughput` cuts them, the first `shared_len` tokens one window common to all) or the first
    `prompt_len` tokens of documents, decoded; or chat questions (MT-Bench first turns, HumanEval, GSM8K) in
    the seeded order `chat_prompts` uses, as text."""
    import random

    from redwood.bench.speculative import make_prompts
    from redwood.data.prompts import _chat_text, short_prefix_prompts
    from redwood.data.recipes import dataset_kind, load_dataset

    if shared_len and not needs_tokenizer(source):
        raise ConfigError(f"--shared-prefix-len cuts long-text windows; {source.label} has chat questions")
    if needs_tokenizer(source):
        if tokenizer is None:
            raise ConfigError(
                f"prompts of exactly --prompt-len tokens from {source.label} need a tokenizer: "
                f"give --tokenizer (the served model's HF folder, .gguf file or zoo name)"
            )
        if source.prompts_file or dataset_kind(source.dataset) == "long":
            from redwood.bench.throughput import shared_prefix_prompts

            ids = shared_prefix_prompts(
                lambda n, length, s: make_prompts(tokenizer, source, n, length, s), count, prompt_len, shared_len, seed
            )
        else:
            if shared_len:
                raise ConfigError(
                    f"--shared-prefix-len cuts long-text windows; {source.label} has documents or questions"
                )
            ids = short_prefix_prompts(tokenizer, source.dataset, count, prefix_tokens=prompt_len, seed=seed)
        return [tokenizer.decode(p) for p in ids]
    docs = load_dataset(source.dataset)
    if count > len(docs):
        raise ConfigError(f"dataset {source.dataset} has {len(docs)} prompts, --num-requests {count} asked for")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    return [_chat_text(docs[i]) for i in order[:count]]


def token_counter(tokenizer) -> Callable[[str], int] | None:
    """Tokens in a piece of text (to apportion a request's tokens over its chunks), or None."""
    if tokenizer is None:
        return None
    from redwood.data.prompts import encode

    return lambda text: len(encode(tokenizer, text))


# ------------------------------------------------------------------------------------------ one request
@dataclass
class RequestResult:
    """One request on the run's clock (seconds from the run's start)."""

    index: int
    scheduled: float  # its Poisson arrival time
    requested: int  # max_tokens
    sent: float | None = None
    end: float | None = None  # the stream (or the error response) ended
    chunk_times: list[float] = field(default_factory=list)  # each content chunk
    chunk_texts: list[str] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens the server said the chunk carries
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None  # None = success
    error_kind: str | None = None  # "400", "503", "stream", "connection", "timeout"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)


def request_body(settings: Settings, prompt: str, max_tokens: int, index: int) -> dict[str, Any]:
    """The JSON body of request `index` (streaming, usage in a last chunk)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": int(max_tokens),
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if settings.seed is not None:
        body["seed"] = settings.seed + index
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM / llama.cpp / redwood extension
    return body


def error_message(raw: bytes) -> str:
    """The message of an error response: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300] or "(empty response)"
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:300]
    return text[:300]


def _chunk_content(choice: dict, chat: bool) -> tuple[str, int | None]:
    """A streamed choice's text and, when the server says, how many tokens it carries."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        text = choice.get("text") or ""
    count = None
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    if isinstance(ids, list):
        count = len(ids)
    elif isinstance(logprobs, dict):
        tokens = logprobs.get("content") if chat else logprobs.get("tokens")
        if isinstance(tokens, list):
            count = len(tokens)
    return text, count


async def stream_request(
    client, url: str, settings: Settings, body: dict, result: RequestResult, clock: Callable[[], float]
) -> None:
    """Send one streaming request and fill `result` in (chunks, usage, finish, or the error)."""
    import httpx

    try:
        async with client.stream("POST", url, json=body, headers=settings.headers()) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.error, result.error_kind = error_message(await resp.aread()), str(resp.status_code)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments, event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    result.error, result.error_kind = f"not JSON in the stream: {data[:200]!r}", "stream"
                    return
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    err = chunk["error"]
                    result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                    result.error_kind = "stream"
                    return
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                for choice in chunk.get("choices") or []:
                    text, count = _chunk_content(choice, settings.chat)
                    if text or count:
                        result.chunk_times.append(clock())
                        result.chunk_texts.append(text)
                        result.chunk_tokens.append(count)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except httpx.TimeoutException as e:
        result.error = f"no data for {settings.timeout_s:g} s ({type(e).__name__})"
        result.error_kind = "timeout"
    except httpx.HTTPError as e:
        result.error, result.error_kind = f"{type(e).__name__}: {e}"[:300], "connection"
    finally:
        result.end = clock()


# --------------------------------------------------------------------------------------------- driving
def make_client(settings: Settings):
    """An httpx client with no connection cap of its own (the benchmark decides how many are in flight)."""
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def run_load(
    client,
    settings: Settings,
    prompts: Sequence[str],
    lengths: Sequence[int],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Send request i at arrivals[i] s after the start (waiting for a free slot under `max_concurrency`);
    → {"results": [RequestResult], "max_in_flight": int}."""
    n = len(prompts)
    if not len(lengths) == len(arrivals) == n:
        raise ConfigError(f"{n} prompts, {len(lengths)} lengths and {len(arrivals)} arrival times")
    url = settings.base_url + settings.endpoint
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = {"now": 0, "max": 0}
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(i: int) -> RequestResult:
        result = RequestResult(i, float(arrivals[i]), int(lengths[i]))
        await asyncio.sleep(max(0.0, arrivals[i] - clock()))
        if slots is not None:
            await slots.acquire()
        try:
            in_flight["now"] += 1
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
            result.sent = clock()
            await stream_request(
                client, url, settings, request_body(settings, prompts[i], lengths[i], i), result, clock
            )
        finally:
            in_flight["now"] -= 1
            if slots is not None:
                slots.release()
            if progress is not None:
                progress(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return {"results": list(results), "max_in_flight": in_flight["max"]}


async def server_model(client, settings: Settings) -> str:
    """The first model id of GET /v1/models (the default --model)."""
    import httpx

    url = settings.base_url + "/v1/models"
    try:
        resp = await client.get(url, headers=settings.headers())
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if resp.status_code == 401:
        raise ServerError(
            f"{url} refused the request (401{' without an API key: give --api-key' if not settings.api_key else ': wrong --api-key'})"
        )
    if resp.status_code != 200:
        raise ServerError(f"GET {url} answered {resp.status_code}: {error_message(resp.content)} (give --model)")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"GET {url} listed no model (give --model)") from None


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def spec_counters(metrics_text: str) -> dict[str, float]:
    """Sums of the vLLM-named speculation counters in a Prometheus text exposition (any prefix, ``_total``
    or not, all label sets), e.g. {"spec_decode_num_drafts": 12.0, …}; {} when there are none."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue  # comments (# HELP / # TYPE), blank lines
        name = m.group(1).removesuffix("_total")
        key = next((k for k in SPEC_COUNTERS if name == k or name.endswith((":" + k, "_" + k))), None)
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(m.group(2))
        except ValueError:
            continue
    return out


async def read_spec_counters(client, settings: Settings) -> dict[str, float] | None:
    """The server's speculation counters from GET /metrics, or None (no such endpoint or counters)."""
    import httpx

    try:
        resp = await client.get(settings.base_url + "/metrics", headers=settings.headers())
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return spec_counters(resp.text) or None


def spec_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Acceptance over a run from the counters' growth (nothing when the server has none or drafted none)."""
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts, drafted, accepted = (
        d["spec_decode_num_drafts"],
        d["spec_decode_num_draft_tokens"],
        d["spec_decode_num_accepted_tokens"],
    )
    if drafted <= 0:
        return {}
    return {
        "acceptance_rate": accepted / drafted,
        "mean_accepted_length": 1 + accepted / drafts if drafts > 0 else None,
        "server_spec_counters": d,
    }


# --------------------------------------------------------------------------------------------- metrics
def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` tokens split over chunks in proportion to `weights` (largest remainder), each chunk at least
    one token; with fewer tokens than chunks, one per chunk (the count can't be spread)."""
    k = len(weights)
    if k == 0:
        return []
    if total <= k:
        return [1] * k
    w = [max(float(x), 0.0) for x in weights]
    if sum(w) <= 0:
        w = [1.0] * k
    quotas = [total * x / sum(w) for x in w]
    parts = [int(q) for q in quotas]
    for j in sorted(range(k), key=lambda j: (parts[j] - quotas[j], j))[: total - sum(parts)]:
        parts[j] += 1
    for j in range(k):
        while parts[j] < 1:
            donor = max(range(k), key=lambda i: parts[i])
            parts[donor] -= 1
            parts[j] += 1
    return parts


def chunk_token_counts(r: RequestResult, count_tokens: Callable[[str], int] | None = None) -> tuple[list[int], str]:
    """Tokens carried by each content chunk of `r`, and where the counts came from: "server" (each chunk
    said), "tokenizer" or "chars" (the usage total apportioned by the chunks' token / character counts)."""
    if r.chunk_tokens and all(c is not None for c in r.chunk_tokens):
        return [int(c) for c in r.chunk_tokens], "server"
    total = output_token_count(r, count_tokens)
    if count_tokens is not None:
        return apportion(total, [max(1, count_tokens(t)) for t in r.chunk_texts]), "tokenizer"
    return apportion(total, [max(1, len(t)) for t in r.chunk_texts]), "chars"


def output_token_count(r: RequestResult, count_tokens: Callable[[str], int] | None = None) -> int:
    """The request's output tokens: the server's usage count, else the server's per-chunk counts, else the
    tokenizer's count of the text, else one per content chunk."""
    if r.output_tokens is not None:
        return int(r.output_tokens)
    if r.chunk_tokens and all(c is not None for c in r.chunk_tokens):
        return sum(int(c) for c in r.chunk_tokens)
    if count_tokens is not None and r.chunk_texts:
        return max(len(r.chunk_texts), count_tokens(r.text))
    return len(r.chunk_texts)


def latency_samples(
    results: Sequence[RequestResult], count_tokens: Callable[[str], int] | None = None
) -> tuple[dict[str, list[float]], list[str]]:
    """Latency samples (seconds) of the successful requests (ttft, itl per token, chunk_itl, tpot, e2e), and
    each request's token-count source."""
    out: dict[str, list[float]] = {k: [] for k in LATENCY_KEYS}
    sources: list[str] = []
    for r in results:
        if not r.ok or r.sent is None:
            continue
        out["e2e"].append(r.end - r.sent)
        if not r.chunk_times:
            continue
        out["ttft"].append(r.chunk_times[0] - r.sent)
        counts, source = chunk_token_counts(r, count_tokens)
        sources.append(source)
        for k in range(1, len(r.chunk_times)):
            gap = r.chunk_times[k] - r.chunk_times[k - 1]
            out["chunk_itl"].append(gap)
            out["itl"] += [gap / counts[k]] * counts[k]
        tokens = output_token_count(r, count_tokens)
        if tokens > 1:
            out["tpot"].append((r.chunk_times[-1] - r.chunk_times[0]) / (tokens - 1))
    return out, sources


def summarize(
    load: dict[str, Any],
    label: str,
    rate: float,
    max_concurrency: int | None,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """One run's record from `run_load`'s output."""
    results: list[RequestResult] = load["results"]
    ok = [r for r in results if r.ok]
    sent = [r.sent for r in results if r.sent is not None]
    start, end = min(sent, default=0.0), max((r.end for r in results if r.end is not None), default=0.0)
    duration = end - start
    tokens = sum(output_token_count(r, count_tokens) for r in ok)
    by_kind: dict[str, int] = {}
    for r in results:
        if not r.ok:
            by_kind[r.error_kind or "?"] = by_kind.get(r.error_kind or "?", 0) + 1
    run: dict[str, Any] = {
        "label": label,
        "request_rate": rate_label(rate),
        "max_concurrency": max_concurrency,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "errors_by_status": dict(sorted(by_kind.items())),
        "error_samples": [
            {"id": r.index, "status": r.status, "kind": r.error_kind, "message": r.error} for r in results if not r.ok
        ][:ERROR_SAMPLES],
        "duration_s": duration,
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "max_in_flight": load["max_in_flight"],
        "usage_missing": sum(1 for r in ok if r.output_tokens is None),
    }
    samples, sources = latency_samples(results, count_tokens)
    for key, values in samples.items():
        ms = [1e3 * v for v in values]
        run[f"{key}_ms_p50"], run[f"{key}_ms_p99"] = percentile(ms, 50), percentile(ms, 99)
        run[f"{key}_ms_mean"] = sum(ms) / len(ms) if ms else None
    run["token_counts"] = (
        "server" if sources and all(s == "server" for s in sources) else "+".join(sorted(set(sources))) or None
    )
    run["all_completed"] = not run["errors"]
    run["per_request"] = [
        {
            "id": r.index,
            "scheduled_s": r.scheduled,
            "sent_s": r.sent,
            "requested_tokens": r.requested,
            "output_tokens": output_token_count(r, count_tokens) if r.ok else None,
            "prompt_tokens": r.prompt_tokens,
            "chunks": len(r.chunk_times),
            "finish_reason": r.finish_reason,
            "status": r.status,
            "error": r.error,
            "ttft_ms": 1e3 * (r.chunk_times[0] - r.sent) if r.ok and r.chunk_times else None,
            "e2e_ms": 1e3 * (r.end - r.sent) if r.ok and r.end is not None else None,
        }
        for r in results
    ]
    return run


# --------------------------------------------------------------------------------------------- the bench
async def run_bench(
    settings: Settings,
    prompts: Sequence[str],
    lengths: Sequence[int],
    rates: Sequence[float],
    concurrencies: Sequence[int | None] = (None,),
    *,
    label: str = "run",
    workload_seed: int = 0,
    warmup: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure every (concurrency, rate) over the same prompts, lengths and (per rate) arrival times."""
    import gc

    # A full collection over a big heap (tokenizer, torch, transformers) stalls the event loop for 100s of
    # ms and lands in someone's TTFT: move everything alive now out of the collector's sight for the runs.
    gc.collect()
    gc.freeze()
    try:
        return await _measure(
            settings, prompts, lengths, rates, concurrencies, label, workload_seed, warmup, count_tokens, progress
        )
    finally:
        gc.unfreeze()


async def _measure(
    settings, prompts, lengths, rates, concurrencies, label, workload_seed, warmup, count_tokens, progress
) -> dict[str, Any]:
    """run_bench's runs: the warm-up, then one `run_load` per (concurrency, rate) on one client."""
    n = len(prompts)
    runs = []
    async with make_client(settings) as client:
        warm = None
        if warmup:
            k = min(warmup, n)
            warm = await run_load(client, settings, prompts[:k], [min(16, m) for m in lengths[:k]], [0.0] * k)
        for cap in concurrencies:
            for rate in rates:
                bar = None
                if progress:
                    from tqdm import tqdm

                    bar = tqdm(
                        total=n,
                        desc=f"{label} @ {rate_label(rate)} req/s" + (f", ≤{cap} in flight" if cap else ""),
                        unit="req",
                        file=sys.stderr,
                        leave=False,
                    )
                before = await read_spec_counters(client, settings)
                try:
                    load = await run_load(
                        client,
                        settings,
                        prompts,
                        lengths,
                        poisson_arrivals(n, rate, workload_seed),
                        cap,
                        None if bar is None else bar.update,
                    )
                finally:
                    if bar is not None:
                        bar.close()
                after = await read_spec_counters(client, settings)
                run = summarize(load, label, rate, cap, count_tokens)
                run.update(spec_stats(before, after))
                runs.append(run)
    return {
        "kind": "serve",
        "label": label,
        "base_url": settings.base_url,
        "endpoint": settings.endpoint,
        "model": settings.model,
        "request_rates": [rate_label(r) for r in rates],
        "max_concurrency": list(concurrencies),
        "runs": runs,
        "warmup_errors": None if warm is None else sum(1 for r in warm["results"] if not r.ok),
    }


# ----------------------------------------------------------------------------------------------- output
def _ms(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _pair(run: dict, key: str) -> str:
    return f"{_ms(run.get(f'{key}_ms_p50'))}/{_ms(run.get(f'{key}_ms_p99'))}"


def _load_text(run: dict) -> str:
    rate = run["request_rate"]
    text = rate if isinstance(rate, str) else f"{rate:g}"
    return text + (f" ≤{run['max_concurrency']}" if run.get("max_concurrency") else "")


def format_runs(runs: Sequence[dict]) -> list[str]:
    """Table lines: per run its label, load, successes / errors, tokens/s and latency p50/p99."""
    lines = [
        f"{'label':<16} {'rate ≤conc':>11} {'ok':>5} {'err':>4} {'tok/s':>9} {'req/s':>7}  "
        f"{'TTFT p50/p99':>13} {'ITL p50/p99':>12} {'chunk ITL':>11} {'TPOT p50':>8} {'e2e p50/p99':>12}"
    ]
    for r in runs:
        lines.append(
            f"{str(r.get('label'))[:16]:<16} {_load_text(r):>11} {r['completed']:>5} {r['errors']:>4} "
            f"{r['tokens_per_s']:>9.1f} {r['request_throughput']:>7.2f}  {_pair(r, 'ttft'):>13} "
            f"{_pair(r, 'itl'):>12} {_pair(r, 'chunk_itl'):>11} {_ms(r.get('tpot_ms_p50')):>8} "
            f"{_pair(r, 'e2e'):>12}"
        )
    return lines


def format_result(r: dict[str, Any]) -> str:
    """The short table of one benchmark, its notes and errors."""
    s = r["settings"]
    sampling = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-p {s['top_p']}"
    tokens = f"{s['min_tokens']}-{s['max_tokens']}" if s.get("min_tokens") else f"{s['max_tokens']}"
    lines = [
        f"serve: {r['model']} at {r['base_url']}{r['endpoint']} ({r['label']})",
        f"{s['num_requests']} requests, prompts from {s['prompts']}"
        + (f" ({s['prompt_len']} tokens)" if s.get("token_exact") else "")
        + f", {tokens} output tokens each ({sampling}{', EOS ignored' if s['ignore_eos'] else ''})",
    ]
    lines += format_runs(r["runs"])
    lines.append(
        "latencies in ms; tok/s = output tokens / (last finish − first send); ITL per token (a chunk's "
        "gap over its tokens), chunk ITL per streamed chunk"
    )
    for run in r["runs"]:
        if "acceptance_rate" in run:
            lines.append(
                f"{_load_text(run)}: server speculation acceptance {run['acceptance_rate']:.3f}, "
                f"{run['mean_accepted_length'] or 0:.2f} tokens per step"
            )
        if run["errors"]:
            kinds = ", ".join(f"{k}: {v}" for k, v in run["errors_by_status"].items())
            first = run["error_samples"][0]
            lines.append(
                f"{_load_text(run)}: {run['errors']} of {run['num_requests']} requests failed ({kinds}); "
                f"first: {first['message']}"
            )
        if run["usage_missing"]:
            lines.append(
                f"{_load_text(run)}: {run['usage_missing']} responses had no usage chunk (tokens counted from the text)"
            )
    if r.get("warmup_errors"):
        lines.append(f"note: {r['warmup_errors']} warm-up requests failed")
    return "\n".join(lines)


def _labelled_runs(reports: Sequence[tuple[str, dict]]) -> list[tuple[str, list[dict]]]:
    return [
        (name, [x for x in rep.get("runs", []) if isinstance(x, dict) and "tokens_per_s" in x]) for name, rep in reports
    ]


def write_plot(path: str | Path, reports: Sequence[tuple[str, dict]]) -> Path:
    """serve.png: TTFT and per-token ITL (p50 solid, p99 dashed) vs output tokens/s, one colour per label;
    `reports`: (label, report or result) pairs, each a line through its runs in load order."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = {"ttft": fig.add_subplot(1, 2, 1), "itl": fig.add_subplot(1, 2, 2)}
    colors = [f"C{i}" for i in range(10)]
    for i, (name, runs) in enumerate(_labelled_runs(reports)):
        xs = [x["tokens_per_s"] for x in runs]
        for key, ax in axes.items():
            for p, style in (("p50", "-"), ("p99", "--")):
                ys = [float("nan") if x.get(f"{key}_ms_{p}") is None else x[f"{key}_ms_{p}"] for x in runs]
                ax.plot(xs, ys, marker="o", linestyle=style, color=colors[i % 10], label=f"{name} {p}")
            for x, run in zip(xs, runs):
                y = run.get(f"{key}_ms_p50")
                if y is not None:
                    ax.annotate(_load_text(run), (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes.values():
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.set_xlim(left=0)
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_formatter(plain)  # 30, not 3×10¹; the minor ticks labelled within one decade
        ax.yaxis.set_minor_formatter(plain if lo > 0 and hi / lo < 10 else NullFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes["ttft"].set_title("TTFT vs throughput (p50 solid, p99 dashed)")
    axes["itl"].set_title("Per-token ITL vs throughput (p50 solid, p99 dashed)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def to_report(r: dict[str, Any], cli: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `write_report` form (schema redwood.bench/1) of a result."""
    aggregate: dict[str, Any] = {}
    if r["runs"]:
        best = max(r["runs"], key=lambda x: x["tokens_per_s"])
        aggregate.update(
            best_tokens_per_s=best["tokens_per_s"],
            at_request_rate=best["request_rate"],
            at_max_concurrency=best["max_concurrency"],
            errors=sum(x["errors"] for x in r["runs"]),
        )
    return {
        "kind": "serve",
        "title": r["label"],
        "models": {"target": r["model"]},
        "config": {
            "label": r["label"],
            "base_url": r["base_url"],
            "endpoint": r["endpoint"],
            **r["settings"],
            "cli": cli or {},
        },
        "runs": r["runs"],
        "aggregate": aggregate,
        "warmup_errors": r.get("warmup_errors"),
    }


def load_reports(paths: Sequence[str | Path]) -> list[tuple[str, dict]]:
    """(label, report) of each serve report (a report.json or its folder); labels made unique by file name."""
    from redwood.bench.report import read_report

    out = []
    for p in paths:
        rep = read_report(p)
        if rep.get("kind") != "serve":
            raise ConfigError(f"--compare {p}: a {rep.get('kind')!r} report, not one of bench serve")
        out.append((str(rep.get("title") or (rep.get("config") or {}).get("label") or Path(p).stem), rep))
    names = [n for n, _ in out]
    if len(set(names)) < len(names):
        out = [
            (f"{n} ({Path(p).parent.name if Path(p).name == 'report.json' else Path(p).name})", rep)
            for (n, rep), p in zip(out, paths)
        ]
    return out


def format_comparison(reports: Sequence[tuple[str, dict]]) -> str:
    """Every report's runs in one table; at each load the first report also ran, tokens/s and p99 ITL ratios
    to the first report's (the first is the baseline, e.g. no speculation)."""
    labelled = _labelled_runs(reports)
    lines = format_runs([{**x, "label": name} for name, runs in labelled for x in runs])
    base_name, base_runs = labelled[0]
    base = {(str(x["request_rate"]), x.get("max_concurrency")): x for x in base_runs}
    for name, runs in labelled[1:]:
        for x in runs:
            b = base.get((str(x["request_rate"]), x.get("max_concurrency")))
            if b is None:
                continue
            tps = x["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
            itl = x["itl_ms_p99"] / b["itl_ms_p99"] if b.get("itl_ms_p99") and x.get("itl_ms_p99") is not None else None
            lines.append(
                f"{name} / {base_name} at {_load_text(x)}: tok/s "
                f"{'–' if tps is None else f'{tps:.2f}x'}, ITL p99 {'–' if itl is None else f'{itl:.2f}x'}"
            )
    return "\n".join(lines)
