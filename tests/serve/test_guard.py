"""Bad input never takes the server down: every case gets its status and OpenAI error JSON
({"error": {"message", "type", "param", "code"}}), and the process keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL_NAME, "prompt": "The quick", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def post(url, path, body, headers=AUTH, **kw):
    return httpx.post(
        url + path,
        headers=headers,
        timeout=30,
        **kw,
        **({"json": body} if not isinstance(body, (str, bytes)) else {"content": body}),
    )


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


BAD_COMPLETIONS = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"stream_options": {"include_usage": True}}, None),  # without stream
    ({"stream": True, "stream_options": {"bogus": True}}, "stream_options"),
    ({"logprobs": 21}, "logprobs"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"frequency_penalty": 0.5}, None),
    ({"echo": True}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 100000]}, "prompt"),  # a token id outside the vocabulary
]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[json.dumps(c) for c, _ in BAD_COMPLETIONS])
def test_bad_completion_parameters_are_400(server_url, change, param):
    assert_error(post(server_url, "/v1/completions", {**COMPLETION, **change}), 400, param=param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user"}], "top_logprobs": 2}, None),  # top_logprobs without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 1.0}, None),
]


@pytest.mark.parametrize("change,param", BAD_CHATS, ids=[json.dumps(c) for c, _ in BAD_CHATS])
def test_bad_chat_parameters_are_400(server_url, change, param):
    assert_error(post(server_url, "/v1/chat/completions", {**CHAT, **change}), 400, param=param)


def test_malformed_bodies_are_400(server_url):
    err = assert_error(
        post(server_url, "/v1/completions", b"{not json", headers={**AUTH, "content-type": "application/json"}), 400
    )
    assert "JSON" in err["message"]
    assert_error(post(server_url, "/v1/completions", [1, 2]), 400)
    assert_error(post(server_url, "/v1/completions", {"model": MODEL_NAME}), 400, param="prompt")  # missing


def test_prompt_longer_than_the_context_is_400(server_url):
    long = " ".join(["fox"] * 400)  # > 256 tokens: the tiny model's context
    for path, body in (
        ("/v1/completions", {**COMPLETION, "prompt": long}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long}]}),
    ):
        assert_error(post(server_url, path, body), 400, code="context_length_exceeded")
    # prompt + max_tokens over the context, as OpenAI and vLLM answer
    assert_error(
        post(server_url, "/v1/completions", {**COMPLETION, "max_tokens": 300}),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )


def test_unknown_model_is_404(server_url):
    assert_error(
        post(server_url, "/v1/completions", {**COMPLETION, "model": "gpt-4"}),
        404,
        param="model",
        code="model_not_found",
    )
    assert_error(httpx.get(server_url + "/v1/models/gpt-4", headers=AUTH, timeout=10), 404, code="model_not_found")
    assert_error(httpx.get(server_url + "/v1/nothing-here", headers=AUTH, timeout=10), 404)


def test_api_key_is_required_on_v1(server_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(post(server_url, "/v1/completions", COMPLETION, headers=headers), 401, code="invalid_api_key")
        assert_error(httpx.get(server_url + "/v1/models", headers=headers, timeout=10), 401)
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200
    assert post(server_url, "/v1/completions", COMPLETION).status_code == 200


def test_server_survives_every_bad_request(server, server_url):
    """(after the cases above, in the same session) the process is up and still answers correctly."""
    assert server.alive
    r = post(server_url, "/v1/completions", COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "unhandled error" not in server.log()  # (no bad input reached the 500 handler)


@pytest.fixture(scope="module")
def small_server(serve_factory):
    """One slot, one waiting request at most, 2 kB bodies."""
    return serve_factory("--max-num-seqs", "1", "--max-queue", "1", "--max-request-bytes", "2000")


def test_body_over_the_limit_is_413(small_server):
    url = small_server.url
    big = {**COMPLETION, "prompt": "x" * 3000}
    assert_error(post(url, "/v1/completions", big, headers={}), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit holds while the body streams in
        yield json.dumps(big).encode()

    assert_error(
        httpx.post(
            url + "/v1/completions", content=chunked(), timeout=30, headers={"content-type": "application/json"}
        ),
        413,
    )
    assert post(url, "/v1/completions", COMPLETION, headers={}).status_code == 200


def test_full_queue_is_503(small_server):
    """The slot busy, one request waiting: the next gets 503 at once; the two others complete."""
    url = small_server.url
    long = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # it holds the slot now
            with c.stream("POST", url + "/v1/completions", json=long) as waiting:
                r = c.post(url + "/v1/completions", json=COMPLETION)
                assert_error(r, 503, code="queue_full")
                assert waiting.status_code == 200
                assert [x for x in waiting.iter_lines() if x][-1] == "data: [DONE]"
            assert [x for x in lines if x][-1] == "data: [DONE]"
    assert small_server.alive
