"""What every HTTP request passes before a route sees it (one ASGI middleware, so streamed responses
go through untouched): 503 while the server drains, 401 on the /v1 routes without the API key, 413
for a body over the size limit.

The body is read here in full (up to the limit) and replayed to the app, so an oversized upload is
refused before any parsing, whether or not it declared a Content-Length. Later `receive()` calls go
to the server's own, so the app still hears when the client disconnects.
"""

from __future__ import annotations

import hmac
import json

from redwood.serve.protocol import APIError


async def send_error(send, error: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware. state: the app's `ServeState` (draining flag, api_key, max_request_bytes)."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        if state.draining and path != "/metrics":
            return await send_error(
                send, APIError(503, "the server is shutting down", "service_unavailable_error", code="draining")
            )
        if state.api_key is not None and path.startswith("/v1"):
            if not _authorized(scope, state.api_key):
                return await send_error(
                    send,
                    APIError(
                        401,
                        "missing or wrong API key: send 'Authorization: Bearer KEY'",
                        "authentication_error",
                        code="invalid_api_key",
                    ),
                    [(b"www-authenticate", b"Bearer")],
                )
        limit = state.max_request_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await send_error(send, _too_large(limit))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # (the client left before sending its body)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_error(send, _too_large(limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than the server's limit of {limit} bytes", code="request_too_large"
    )


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _authorized(scope, key: str) -> bool:
    given = _header(scope, b"authorization") or ""
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
