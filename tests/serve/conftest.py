"""Fixtures for the server's tests: real `redwood serve` subprocesses over the tiny models.

`serve_factory(*flags)` starts a server (loopback, free port; --model defaults to the tiny target) and
stops it at the end of the session; `server` is the shared plain one (no speculation), `server_url` its
base URL (it wants --api-key API_KEY). The tiny tokenizer of tests/conftest.py has a chat template, so chat works as with a real
instruct model.
"""

from __future__ import annotations

import pytest

from tests.serve.server_process import ServerProcess, start_server

MODEL_NAME = "tiny"  # --served-model-name of the shared servers
API_KEY = "test-key"  # the shared `server`'s --api-key (send it as `Authorization: Bearer test-key`)


@pytest.fixture(scope="session")
def serve_factory(tiny_model_dir):
    """start(*flags, model=None) → a running ServerProcess (stopped at the session's end)."""
    started: list[ServerProcess] = []

    def start(*flags: str, model=None, served_name: str | None = MODEL_NAME) -> ServerProcess:
        args = ["--model", str(model or tiny_model_dir)]
        if served_name is not None:
            args += ["--served-model-name", served_name]
        server = start_server(args + list(flags))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(timeout=30)


@pytest.fixture(scope="session")
def server(serve_factory) -> ServerProcess:
    return serve_factory("--max-num-seqs", "16", "--api-key", API_KEY)


@pytest.fixture(scope="session")
def server_url(server) -> str:
    return server.url
