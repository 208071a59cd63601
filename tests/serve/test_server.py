"""SIGTERM drains: the running request finishes in full, a new one is refused (503 while draining, or
the connection once the socket is closed), and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.serve.conftest import MODEL_NAME


def test_sigterm_lets_running_requests_finish_then_exits_0(serve_factory):
    server = serve_factory()
    body = {
        "model": MODEL_NAME,
        "prompt": "The quick",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first_chunk, lines = threading.Event(), []

    def long_request():
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert first_chunk.wait(30)
    server.signal(signal.SIGTERM)
    try:
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    except httpx.ConnectError:
        pass  # (the running request was already done: the socket is closed)
    t.join(60)
    assert not t.is_alive()
    data = [x.removeprefix("data: ") for x in lines if x]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["usage"]["completion_tokens"] == 200  # it ran to the end
    assert server.wait(timeout=30) == 0
    assert "serving tiny on http://127.0.0.1:" in server.log()
