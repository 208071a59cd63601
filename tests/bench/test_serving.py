"""`redwood bench serve`: the load generator against a stand-in OpenAI SSE server (stdlib asyncio streams,
known chunks at known delays) — latency and throughput arithmetic, error counting, arrivals, the
concurrency cap, bad flags — and end to end against `redwood serve` with a tiny model."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

from redwood.bench.serving import apportion, error_message, normalize_base_url, parse_endpoint, spec_counters
from redwood.bench.throughput import poisson_arrivals
from redwood.cli import main
from tests.conftest import CORPUS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORD = " fox"  # the tiny tokenizer spends the same number of tokens on each repeat of it


@pytest.fixture(autouse=True)
def time_limit():
    """Every test here ends within 90 s (a hung stream fails the test instead of the suite)."""

    def expire(signum, frame):
        raise TimeoutError("test_serving: over 90 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(90)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------ the stand-in server
class StandIn:
    """An OpenAI-compatible streaming server on 127.0.0.1 in its own thread and event loop.

    Each completion waits `ttft` s, then streams one content chunk per entry of `chunks` (that many
    repeats of WORD, i.e. that many "tokens"; `gap` s apart), then a usage chunk and [DONE]. A request's
    `seed` picks a failure through `fail` (seed → "400" | "503" | "stream" | "drop" | None). Records each
    request's arrival time and body, and the most requests in flight at once.
    """

    def __init__(
        self,
        *,
        ttft=0.05,
        gap=0.02,
        chunks=(1,),
        fail=None,
        usage=True,
        token_ids=False,
        api_key=None,
        model="stand-in",
    ):
        self.ttft, self.gap, self.chunks, self.fail = ttft, gap, tuple(chunks), fail or (lambda seed: None)
        self.usage, self.token_ids, self.api_key, self.model = usage, token_ids, api_key, model
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.served = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop
        ).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc):
        async def stop():
            self.server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def handle(self, reader, writer):
        try:
            while True:  # keep-alive: one request after another on this connection
                line = await reader.readline()
                if not line:
                    break
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self.route(method, path.split("?")[0], headers, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def send_json(writer, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}[
            status
        ]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    @staticmethod
    async def send_event(writer, obj) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    def metrics(self) -> str:
        n = self.served  # each served request drafted 3 times, 3 tokens each, and 6 were accepted
        return (
            "# HELP vllm:spec_decode_num_drafts_total drafts\n# TYPE vllm:spec_decode_num_drafts_total counter\n"
            f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {3 * n}\n'
            f"vllm:spec_decode_num_drafts_created 1.7e9\n"
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {9 * n}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {6 * n}\n'
        )

    async def route(self, method, path, headers, body, writer) -> bool:
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            await self.send_json(writer, 401, {"error": {"message": "bad key", "type": "auth", "code": 401}})
            return True
        if method == "GET" and path == "/v1/models":
            await self.send_json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
            return True
        if method == "GET" and path == "/metrics":
            data = self.metrics().encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                + str(len(data)).encode()
                + b"\r\n\r\n"
                + data
            )
            await writer.drain()
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await self.send_json(writer, 404, {"error": {"message": f"no route {path}"}})
            return True
        req = json.loads(body)
        self.arrivals.append(time.perf_counter())
        self.bodies.append(req)
        self.headers.append(headers)
        chat = path.endswith("chat/completions")
        failure = self.fail(req.get("seed"))
        if failure in ("400", "503"):
            await self.send_json(writer, int(failure), {"error": {"message": f"refused with {failure}"}})
            return True
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            await asyncio.sleep(self.ttft)
            for k, m in enumerate(self.chunks):
                if k:
                    await asyncio.sleep(self.gap)
                if failure == "stream" and k == 1:
                    await self.send_event(writer, {"error": {"message": "engine died", "code": 500}})
                    break
                if failure == "drop" and k == 1:
                    return False  # close the connection mid-stream
                text = WORD * m
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                choice["finish_reason"] = "length" if k == len(self.chunks) - 1 else None
                if self.token_ids:
                    choice["token_ids"] = list(range(m))
                await self.send_event(writer, {"object": "chunk", "choices": [choice]})
            else:
                if self.usage:
                    await self.send_event(
                        writer, {"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": sum(self.chunks)}}
                    )
                self.served += 1
            await self.send_event(writer, "[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            self.in_flight -= 1


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text("\n".join(CORPUS))
    return path


def _args(server, tiny_model_dir, text_file, *more):
    return [
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--tokenizer",
        str(tiny_model_dir),
        "--prompts-file",
        str(text_file),
        "--prompt-len",
        "16",
        "--max-tokens",
        "8",
        *more,
    ]


def _run(argv, capsys, out_dir=None):
    rc = main(list(argv) + (["--output", str(out_dir)] if out_dir else []) + ["--json"])
    captured = capsys.readouterr()
    return rc, captured, (json.loads(captured.out) if rc in (0, 1) else None)


# ------------------------------------------------------------------------------------------ arithmetic
def test_apportion_spreads_the_usage_total_over_the_chunks():
    assert apportion(7, [1, 3, 2, 1]) == [1, 3, 2, 1]
    assert apportion(7, [4, 12, 8, 4]) == [1, 3, 2, 1]  # proportional: the weights' scale does not matter
    assert apportion(10, [1, 1, 1]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    parts = apportion(5, [100, 1, 1])  # every chunk carried a token
    assert sum(parts) == 5 and min(parts) >= 1
    assert apportion(2, [5, 5, 5]) == [1, 1, 1]  # fewer tokens than chunks: one each
    assert apportion(3, []) == []
    for total in range(4, 30):
        parts = apportion(total, [3, 1, 7, 2])
        assert sum(parts) == total and min(parts) >= 1


def test_spec_counters_read_vllm_names_with_any_prefix():
    text = (
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="a"} 4\n'
        'vllm:spec_decode_num_drafts_total{model_name="b"} 6\n'
        "vllm:spec_decode_num_drafts_created 1.7e9\n"
        "redwood_spec_decode_num_draft_tokens 30.0\n"
        'redwood:spec_decode_num_accepted_tokens_per_pos{position="0"} 9\n'
        "spec_decode_num_accepted_tokens_total 21\n"
    )
    assert spec_counters(text) == {
        "spec_decode_num_drafts": 10.0,
        "spec_decode_num_draft_tokens": 30.0,
        "spec_decode_num_accepted_tokens": 21.0,
    }
    assert spec_counters("http_requests_total 3\n") == {}


def test_small_parsers():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_base_url("https://h/x") == "https://h/x"
    assert parse_endpoint("chat") == parse_endpoint("/v1/chat/completions") == "/v1/chat/completions"
    assert parse_endpoint("completions") == "/v1/completions"
    assert error_message(b'{"error": {"message": "too long", "type": "invalid"}}') == "too long"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"plain failure") == "plain failure"


def test_text_prompts_from_each_kind_of_dataset(monkeypatch, tokenizer, text_file):
    """Long-text windows and document prefixes are exact token counts, decoded; chat questions are the
    documents' prompts in the seeded order of `chat_prompts`, no tokenizer needed."""
    from redwood.bench.serving import text_prompts
    from redwood.bench.speculative import PromptSource
    from redwood.data import prompts as prompt_builders
    from redwood.data import recipes

    questions = [{"id": f"q{i}", "prompt": f"question {i}?", "text": f"question {i}?"} for i in range(6)]
    documents = [{"id": f"d{i}", "text": " ".join(CORPUS[i : i + 3])} for i in range(6)]
    monkeypatch.setattr(recipes, "load_dataset", lambda name, **kw: questions)
    monkeypatch.setattr(prompt_builders, "load_dataset", lambda name, **kw: documents)

    chat = text_prompts(PromptSource(dataset="mt-bench"), 4, 999, seed=1)
    assert sorted(chat) == sorted(set(chat)) and set(chat) <= {q["prompt"] for q in questions}
    assert chat == text_prompts(PromptSource(dataset="mt-bench"), 4, 5, seed=1)  # seeded; the length ignored
    with pytest.raises(Exception, match="has 6 prompts, --num-requests 7"):
        text_prompts(PromptSource(dataset="mt-bench"), 7, 16)

    prefixes = text_prompts(PromptSource(dataset="c4"), 3, 12, tokenizer=tokenizer)
    assert all(len(tokenizer.encode(p, add_special_tokens=False)) == 12 for p in prefixes)
    assert all(any(d["text"].startswith(p) for d in documents) for p in prefixes)
    windows = text_prompts(PromptSource(prompts_file=str(text_file)), 5, 20, seed=2, tokenizer=tokenizer)
    assert len(windows) == 5 and all(w in text_file.read_text() for w in windows)
    assert all(len(tokenizer.encode(w, add_special_tokens=False)) == 20 for w in windows)
    with pytest.raises(Exception, match="need a tokenizer: give --tokenizer"):
        text_prompts(PromptSource(dataset="c4"), 3, 12)

    # one common window first (a shared document), each request's own tail after it
    shared = text_prompts(PromptSource(prompts_file=str(text_file)), 4, 20, seed=2, tokenizer=tokenizer, shared_len=12)
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in shared]
    assert len({tuple(i[:12]) for i in ids}) == 1 and len({tuple(i[12:]) for i in ids}) == 4
    with pytest.raises(Exception, match="--shared-prefix-len cuts long-text windows"):
        text_prompts(PromptSource(dataset="mt-bench"), 4, 20, shared_len=8)
    with pytest.raises(Exception, match="--shared-prefix-len cuts long-text windows"):
        text_prompts(PromptSource(dataset="c4"), 3, 12, tokenizer=tokenizer, shared_len=4)


# ---------------------------------------------------------------------------------- against the stand-in
@pytest.mark.parametrize("token_ids", [False, True], ids=["apportioned", "server-counts"])
def test_latency_and_throughput_arithmetic(tiny_model_dir, text_file, tmp_path, capsys, token_ids):
    """4 requests at once; each: TTFT 200 ms, then chunks of 1, 3, 2, 1 tokens 50 ms apart (7 tokens)."""
    with StandIn(ttft=0.2, gap=0.05, chunks=(1, 3, 2, 1), token_ids=token_ids) as server:
        rc, captured, res = _run(
            _args(server, tiny_model_dir, text_file, "--num-requests", "4", "--label", "x"), capsys, tmp_path / "rep"
        )
    assert rc == 0, captured.err
    (run,) = res["runs"]
    assert run["completed"] == 4 and run["errors"] == 0 and run["output_tokens"] == 28
    assert run["token_counts"] == ("server" if token_ids else "tokenizer")
    assert run["tokens_per_s"] == pytest.approx(28 / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(4 / run["duration_s"])
    assert 0.35 <= run["duration_s"] < 0.8
    tol = 40  # ms of scheduling slack on a loaded machine
    assert run["ttft_ms_mean"] == pytest.approx(200, abs=tol) and run["ttft_ms_p50"] >= 195
    assert run["chunk_itl_ms_mean"] == pytest.approx(50, abs=tol / 2)
    # each 50 ms gap over its chunk's tokens (3, 2, 1): 150 ms / 6 tokens per request
    assert run["itl_ms_mean"] == pytest.approx(25, abs=tol / 4)
    assert run["itl_ms_p50"] < run["chunk_itl_ms_p50"] and run["itl_ms_p99"] == pytest.approx(50, abs=tol / 2)
    assert run["tpot_ms_mean"] == pytest.approx(150 / 6, abs=tol / 4)
    assert run["e2e_ms_mean"] == pytest.approx(350, abs=2 * tol)
    for key in ("ttft", "itl", "chunk_itl", "tpot", "e2e"):
        assert run[f"{key}_ms_p50"] <= run[f"{key}_ms_p99"]
    assert [p["chunks"] for p in run["per_request"]] == [4] * 4
    assert all(p["output_tokens"] == 7 and p["finish_reason"] == "length" for p in run["per_request"])
    # the stand-in's /metrics grew by 3 drafts of 3 tokens, 6 accepted, per request
    assert run["acceptance_rate"] == pytest.approx(6 / 9) and run["mean_accepted_length"] == pytest.approx(3.0)
    # the requests were what the flags asked for
    assert len(server.bodies) == 4
    for body in server.bodies:
        assert body["model"] == "stand-in" and body["max_tokens"] == 8 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and isinstance(body["prompt"], str)
        assert "seed" not in body and "ignore_eos" not in body
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["kind"] == "serve" and rep["title"] == "x" and rep["schema"].startswith("redwood.bench/")
    assert rep["runs"][0]["output_tokens"] == 28 and "serve.png" in rep["plots"]
    assert rep["config"]["endpoint"] == "/v1/completions" and "api_key" not in rep["config"]["cli"]
    assert (tmp_path / "rep" / "serve.png").read_bytes()[:8] == PNG_MAGIC


def test_errors_are_counted_by_status(tiny_model_dir, text_file, capsys):
    """seeds 0..9: seed % 5 == 1 → 400, 2 → 503, 3 → an error object mid-stream, 4 → the connection drops."""
    kinds = {1: "400", 2: "503", 3: "stream", 4: "drop"}
    with StandIn(chunks=(1, 1, 1), fail=lambda seed: kinds.get(seed % 5)) as server:
        rc, captured, res = _run(
            _args(server, tiny_model_dir, text_file, "--num-requests", "10", "--seed", "0", "--ignore-eos"), capsys
        )
    assert rc == 0, captured.err
    (run,) = res["runs"]
    assert run["completed"] == 2 and run["errors"] == 8 and run["all_completed"] is False
    assert run["errors_by_status"] == {"400": 2, "503": 2, "connection": 2, "stream": 2}
    assert run["output_tokens"] == 6  # only the two successful requests' tokens
    by_id = {p["id"]: p for p in run["per_request"]}
    assert by_id[1]["status"] == 400 and by_id[1]["error"] == "refused with 400"
    assert by_id[7]["status"] == 503 and by_id[3]["error"] == "engine died"
    assert [by_id[i]["error"] for i in (0, 5)] == [None, None] and by_id[0]["output_tokens"] == 3
    assert sorted(b["seed"] for b in server.bodies) == list(range(10))
    assert all(b["ignore_eos"] is True for b in server.bodies)
    assert len(run["error_samples"]) == 5 and run["error_samples"][0]["message"] == "refused with 400"


def test_every_request_failing_exits_1_with_the_reason(tiny_model_dir, text_file, capsys):
    with StandIn(fail=lambda seed: "503") as server:
        rc = main(_args(server, tiny_model_dir, text_file, "--num-requests", "3", "--seed", "0"))
    captured = capsys.readouterr()
    assert rc == 1
    assert "3 of 3 requests failed (503: 3); first: refused with 503" in captured.out


def test_poisson_arrivals_follow_the_rate(tiny_model_dir, text_file, capsys):
    """At 25 req/s the stand-in sees the requests at the seeded Poisson times; at inf all at once."""
    with StandIn(ttft=0.01, chunks=(1,)) as server:
        rc, captured, res = _run(
            _args(
                server,
                tiny_model_dir,
                text_file,
                "--num-requests",
                "12",
                "--request-rate",
                "25",
                "inf",
                "--workload-seed",
                "3",
            ),
            capsys,
        )
    assert rc == 0, captured.err
    assert [r["request_rate"] for r in res["runs"]] == [25.0, "inf"]
    assert all(r["completed"] == 12 for r in res["runs"])
    expected = poisson_arrivals(12, 25.0, 3)
    seen = sorted(server.arrivals[:12])
    assert [t - seen[0] for t in seen] == pytest.approx(expected, abs=0.05)
    sent = sorted(p["sent_s"] for p in res["runs"][0]["per_request"])
    assert [s - sent[0] for s in sent] == pytest.approx(expected, abs=0.05)
    burst = server.arrivals[12:]
    assert len(burst) == 12 and max(burst) - min(burst) < 0.25


def test_concurrency_cap_is_never_exceeded(tiny_model_dir, text_file, capsys):
    """9 requests of ~100 ms at rate inf: under a cap of 3 they go in three waves, never more than 3 open;
    a cap of 1 serializes them."""
    with StandIn(ttft=0.1, chunks=(1,)) as server:
        rc, captured, res = _run(
            _args(server, tiny_model_dir, text_file, "--num-requests", "9", "--max-concurrency", "3"), capsys
        )
        assert rc == 0, captured.err
        assert server.max_in_flight == 3 and res["runs"][0]["max_in_flight"] == 3
        assert res["runs"][0]["completed"] == 9 and res["runs"][0]["duration_s"] >= 0.3
        server.max_in_flight = 0
        rc, captured, res = _run(
            _args(server, tiny_model_dir, text_file, "--num-requests", "4", "--max-concurrency", "1", "2"), capsys
        )
    assert rc == 0, captured.err
    assert [r["max_concurrency"] for r in res["runs"]] == [1, 2]
    assert [r["max_in_flight"] for r in res["runs"]] == [1, 2] and server.max_in_flight == 2
    assert res["runs"][0]["duration_s"] >= 0.4


def test_chat_endpoint_api_key_and_default_model(tiny_model_dir, text_file, capsys):
    with StandIn(chunks=(2, 1), api_key="sekrit", model="served-name") as server:
        rc, captured, res = _run(
            _args(
                server,
                tiny_model_dir,
                text_file,
                "--num-requests",
                "2",
                "--endpoint",
                "chat",
                "--api-key",
                "sekrit",
                "--temperature",
                "0.5",
                "--top-p",
                "0.9",
                "--max-tokens",
                "20",
                "--warmup",
                "1",
            ),
            capsys,
        )
        assert rc == 0, captured.err
        assert res["model"] == "served-name" and res["label"] == "served-name" and res["warmup_errors"] == 0
        assert res["runs"][0]["completed"] == 2 and res["runs"][0]["output_tokens"] == 6
        assert [b["max_tokens"] for b in server.bodies] == [16, 20, 20]  # the warm-up first, short
        for body, headers in zip(server.bodies, server.headers):
            assert body["messages"][0]["role"] == "user" and isinstance(body["messages"][0]["content"], str)
            assert body["model"] == "served-name" and body["temperature"] == 0.5 and body["top_p"] == 0.9
            assert headers["authorization"] == "Bearer sekrit"
        rc = main(_args(server, tiny_model_dir, text_file, "--num-requests", "1"))  # no key
    assert rc == 2
    assert "refused the request (401 without an API key: give --api-key)" in capsys.readouterr().err


def test_compare_plots_reports_on_one_figure(tiny_model_dir, text_file, tmp_path, capsys):
    for label, chunks in (("ar", (1, 1, 1, 1)), ("spec", (2, 2))):
        with StandIn(ttft=0.02, gap=0.03, chunks=chunks) as server:
            rc, captured, _ = _run(
                _args(
                    server,
                    tiny_model_dir,
                    text_file,
                    "--num-requests",
                    "3",
                    "--label",
                    label,
                    "--max-concurrency",
                    "1",
                    "3",
                ),
                capsys,
                tmp_path / label,
            )
            assert rc == 0, captured.err
    rc = main(
        [
            "bench",
            "serve",
            "--compare",
            str(tmp_path / "ar" / "report.json"),
            str(tmp_path / "spec"),
            "--output",
            str(tmp_path / "cmp"),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert (tmp_path / "cmp" / "serve.png").read_bytes()[:8] == PNG_MAGIC
    lines = captured.out.splitlines()
    ratios = [line for line in lines if line.startswith("spec / ar at")]
    rows = [line.split()[0] for line in lines[1:] if line not in ratios]
    assert rows == ["ar", "ar", "spec", "spec"]
    assert len(ratios) == 2 and all("tok/s" in line and "ITL p99" in line for line in ratios)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--num-requests", "0"], "--num-requests must be >= 1"),
        (["--min-tokens", "9"], "--min-tokens must be between 1 and --max-tokens (8)"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--request-rate", "fast"], "--request-rate must be a positive number"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--endpoint", "embeddings"], "--endpoint must be completions or chat"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["--shared-prefix-len", "9999"], "--shared-prefix-len must be in [0, --prompt-len"),
        (["--dataset", "essays"], "--dataset and --prompts-file are alternatives"),
    ],
)
def test_bad_flags_get_one_line_errors(tiny_model_dir, text_file, capsys, flags, message):
    with StandIn() as server:
        rc = main(_args(server, tiny_model_dir, text_file, *flags))
        err = capsys.readouterr().err
        assert not server.bodies  # nothing was sent
    assert rc == 2 and err.startswith("redwood: error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "serve"], "bench serve needs --base-url URL"),
        (["bench", "serve", "--base-url", "127.0.0.1:8000"], "--base-url must be an http:// or https:// URL"),
        (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--compare", "x.json"], "drop --base-url"),
        (["bench", "serve", "--compare", "/nonexistent/report.json"], "no report folder"),
        (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "nope"], "unknown dataset 'nope'"),
    ],
)
def test_bad_invocations(argv, message, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("redwood: error: ") and message in err


def test_an_output_that_cannot_be_a_folder_fails_before_any_request(tiny_model_dir, text_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with StandIn() as server:
        rc = main(_args(server, tiny_model_dir, text_file, "--output", str(blocker / "sub")))
        assert not server.bodies
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"redwood: error: --output {blocker / 'sub'}: cannot create the folder")


def test_unreachable_server_and_missing_tokenizer(text_file, capsys):
    with StandIn() as server:
        port = server.port
        rc = main(["bench", "serve", "--base-url", server.url, "--prompts-file", str(text_file)])
        err = capsys.readouterr().err
        assert rc == 2 and "need a tokenizer: give --tokenizer" in err and not server.bodies
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--prompts-file", str(text_file)])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot reach http://127.0.0.1:{port}/v1/models" in err


# ------------------------------------------------------------------------------- against redwood serve
@pytest.fixture(scope="module")
def redwood_servers(tiny_model_dir, tiny_draft_dir):
    """Two real `redwood serve` processes over the tiny target: autoregressive, and speculating with the
    tiny draft (γ 3)."""
    from tests.serve.server_process import start_server

    started = []
    try:
        for extra in ([], ["--draft-model", str(tiny_draft_dir), "--gamma", "3"]):
            started.append(
                start_server(
                    ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "4", *extra],
                    timeout=80,
                )
            )
        yield started
    finally:
        for server in started:
            server.stop(timeout=20)


def test_end_to_end_against_redwood_serve(redwood_servers, tiny_model_dir, text_file, tmp_path, capsys):
    """8 streaming requests per run complete against the real server (AR and speculative), with the usage
    counts the flags ask for; report.json and serve.png written; --compare puts both on one figure."""
    for server, label in zip(redwood_servers, ("ar", "spec")):
        argv = [
            "bench",
            "serve",
            "--base-url",
            server.url + "/v1",
            "--tokenizer",
            str(tiny_model_dir),
            "--prompts-file",
            str(text_file),
            "--prompt-len",
            "24",
            "--max-tokens",
            "12",
            "--min-tokens",
            "6",
            "--ignore-eos",
            "--num-requests",
            "8",
            "--request-rate",
            "50",
            "inf",
            "--max-concurrency",
            "4",
            "--label",
            label,
            "--timeout",
            "60",
        ]
        rc, captured, res = _run(argv, capsys, tmp_path / label)
        assert rc == 0, captured.err + server.log()[-2000:]
        assert res["model"] == "tiny" and len(res["runs"]) == 2
        for run in res["runs"]:
            assert run["completed"] == 8 and run["errors"] == 0, run["error_samples"]
            assert run["max_in_flight"] <= 4
            assert [p["output_tokens"] for p in run["per_request"]] == [
                p["requested_tokens"] for p in run["per_request"]
            ]
            assert all(6 <= p["requested_tokens"] <= 12 and p["finish_reason"] == "length" for p in run["per_request"])
            assert run["output_tokens"] == sum(p["requested_tokens"] for p in run["per_request"])
            assert all(p["prompt_tokens"] and p["prompt_tokens"] > 0 for p in run["per_request"])
            assert run["tokens_per_s"] > 0 and 0 < run["ttft_ms_p50"] <= run["ttft_ms_p99"]
            assert 0 < run["itl_ms_p50"] <= run["itl_ms_p99"] and run["usage_missing"] == 0
            if label == "spec":  # from the server's redwood:spec_decode_* counters
                assert 0 <= run["acceptance_rate"] <= 1 and 1 <= run["mean_accepted_length"] <= 4
            else:
                assert "acceptance_rate" not in run
        rep = json.loads((tmp_path / label / "report.json").read_text())
        assert rep["kind"] == "serve" and [r["completed"] for r in rep["runs"]] == [8, 8]
        assert (tmp_path / label / "serve.png").read_bytes()[:8] == PNG_MAGIC
    rc = main(
        ["bench", "serve", "--compare", str(tmp_path / "ar"), str(tmp_path / "spec"), "--output", str(tmp_path / "cmp")]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "spec / ar at 50 ≤4" in out and "spec / ar at inf ≤4" in out
    assert (tmp_path / "cmp" / "serve.png").read_bytes()[:8] == PNG_MAGIC
    assert all(s.alive for s in redwood_servers)
