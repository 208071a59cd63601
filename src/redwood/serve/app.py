"""The OpenAI-compatible HTTP app over one Engine (FastAPI).

    POST /v1/completions, POST /v1/chat/completions   (stream or not; n choices; logprobs; usage)
    GET  /v1/models, /v1/models/{name}, /health, /metrics, /   (the playground page)

A request is validated (`protocol`), tokenized here (the chat template for chat) on a small thread pool,
never on the event loop: a long prompt takes a noticeable time to encode, and encoding every prompt on the
loop in turn stalled streaming and capped admissions below what the engine steps (the figures:
docs/perf/engine.md, "Figures cited from the source"). The tokenizers library releases the
GIL while it encodes, so the engine thread keeps stepping meanwhile. The prompt is then checked against the
context, turned into n `SamplingParams` (choice i seeded seed + i) and handed to the `EngineLoop` as one
group; its deltas come back on one asyncio queue and are built into OpenAI JSON (`responses`). A
client that disconnects aborts its requests (streaming: Starlette cancels the stream, whose `finally`
aborts; whole responses: a watcher on the connection). Every failure is OpenAI error JSON, never a
traceback, and nothing a request does can stop the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from redwood.errors import ConfigError, ContextLengthError, RedwoodError
from redwood.sampling_params import SamplingParams
from redwood.serve.engine_loop import EngineFailed, EngineLoop, QueueFull
from redwood.serve.guard import Guard
from redwood.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from redwood.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from redwood.serve.responses import (
    SSE_DONE,
    ChoiceState,
    ChunkMaker,
    TokenText,
    chat_response,
    completion_response,
    new_id,
    sse,
)

log = logging.getLogger("redwood.serve")

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
TOKENIZER_THREADS = 4  # prompts encoded at once (at most the CPU count)


@dataclass
class ServeState:
    """What the routes share: the engine loop, metrics, names and limits, the draining flag."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_request_bytes: int
    token_text: TokenText
    draining: bool = False
    created: int = 0
    tokenize_pool: ThreadPoolExecutor | None = None  # prompt encoding off the event loop (lifespan-owned)

    @property
    def engine(self):
        return self.loop.engine


def create_app(
    engine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving `engine` (a loaded `redwood.Engine`); its engine thread runs while the app's
    lifespan does. `app.state.redwood` is the ServeState (`begin_drain()` sets its draining flag)."""
    name = served_model_name or engine.model_name
    metrics = ServerMetrics(name)
    state = ServeState(
        EngineLoop(engine, max_queue=max_queue, observer=metrics),
        metrics,
        name,
        api_key,
        max_request_bytes,
        TokenText(engine.tokenizer),
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app):
        state.tokenize_pool = ThreadPoolExecutor(
            min(TOKENIZER_THREADS, os.cpu_count() or 1), thread_name_prefix="redwood-tokenize"
        )
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.loop.stop()
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="redwood", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.redwood = state
    app.add_middleware(Guard, state=state)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/speculation")
    async def speculation():
        # the speculation policy's state (not an OpenAI route: redwood's own, like /metrics)
        try:
            return await state.loop.speculation_report()
        except EngineFailed as e:
            raise APIError(503, str(e), code="engine_failed") from None

    @app.get("/")
    async def playground():
        page = resources.files("redwood.serve").joinpath("static", "playground.html")
        if not page.is_file():
            raise APIError(404, "the playground page is not installed", code="not_found")
        return Response(page.read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        _check_model(state, model)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = list(
            await asyncio.gather(
                *(
                    _off_loop(state, _encode_text, state, p) if isinstance(p, str) else _ready(list(p))
                    for p in body.prompts()
                )
            )
        )
        return await _generate(
            state, request, body, prompts, "prompt", chat=False, num_logprobs=body.logprobs, max_tokens=body.max_tokens
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        prompt = await _off_loop(state, _apply_chat_template, state, body)
        return await _generate(
            state,
            request,
            body,
            [prompt],
            "messages",
            chat=True,
            num_logprobs=body.num_logprobs,
            max_tokens=body.max_new_tokens,
        )

    return app


# ---------------------------------------------------------------------- requests → engine
def _check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


def _model_card(state: ServeState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "redwood",
        "root": str(state.engine.model_path or state.engine.model_name),
        "max_model_len": state.engine.max_model_len,
    }


async def _off_loop(state: ServeState, fn, *args):
    """fn(*args) on the tokenizer pool (the event loop stays free; its APIError propagates as raised)."""
    if state.tokenize_pool is None:  # (an app used without its lifespan: tests calling routes directly)
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, fn, *args)


async def _ready(value):
    return value


def _encode_text(state: ServeState, text: str) -> list[int]:
    """A text prompt's ids, as offline generation makes them (`Engine.encode`)."""
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
    return state.engine.encode(text)


def _apply_chat_template(state: ServeState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, f"the model '{state.model_name}' has no chat template: use /v1/completions", param="messages"
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # noqa: BLE001 — templates raise what they like (e.g. on role order)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return list(ids)


def _sampling_params(
    body,
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    num_logprobs: int | None,
    seed_offset: int,
    param: str,
) -> SamplingParams:
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but the {param} has "
            f"{prompt_len} tokens (at most {max_model_len - 1} leave room to generate)",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_len + max_tokens} ({prompt_len} in the {param}, {max_tokens} to generate): "
            f"lower max_tokens or shorten the {param}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            # No max_tokens: up to the context. Asked for as the whole context (the Engine caps it by what
            # the prompt leaves), so a request the context stops finishes "context", not "length".
            max_new_tokens=max_tokens if max_tokens is not None else max_model_len,
            seed=None if body.seed is None else body.seed + seed_offset,
            stop=tuple(body.stop or ()),
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs,
        )
    except ConfigError as e:
        raise APIError(400, str(e)) from None


async def _generate(
    state: ServeState,
    request: Request,
    body,
    prompts: list[list[int]],
    param: str,
    *,
    chat: bool,
    num_logprobs: int | None,
    max_tokens: int | None,
):
    rid = new_id("chatcmpl" if chat else "cmpl")
    items, choices = [], []
    for p, ids in enumerate(prompts):
        for i in range(body.n):
            index = p * body.n + i
            params = _sampling_params(body, len(ids), max_tokens, state.engine.max_model_len, num_logprobs, i, param)
            items.append((f"{rid}-{index}", ids, params))
            choices.append(ChoiceState(index, p))
    try:
        handles = await state.loop.submit(items)
    except QueueFull as e:
        raise APIError(503, str(e), "service_unavailable_error", code="queue_full") from None
    except ContextLengthError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    except RedwoodError as e:
        raise APIError(400, str(e)) from None
    except EngineFailed as e:
        raise APIError(500, str(e), "server_error") from None
    by_id = {h.request_id: (h, c) for h, c in zip(handles, choices)}
    prompt_lens = [len(ids) for ids in prompts]
    if body.stream:
        maker = ChunkMaker(rid, state.model_name, chat, state.token_text, num_logprobs, body.stats, body.include_usage)
        return StreamingResponse(
            _stream(state, maker, handles, by_id, choices, prompt_lens),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    await _collect(state, request, handles, by_id)
    build = chat_response if chat else completion_response
    return build(rid, state.model_name, choices, prompt_lens, state.token_text, num_logprobs, body.stats)


async def _collect(state: ServeState, request: Request, handles, by_id) -> None:
    """Wait for every choice's last delta; abort them all if the client disconnects first."""
    queue = handles[0].queue  # (the group's one queue)

    async def drain():
        left = len(handles)
        while left:
            item = await queue.get()
            if isinstance(item, EngineFailed):
                raise APIError(500, str(item), "server_error")
            by_id[item.request_id][1].add(item)
            left -= item.finish_reason is not None

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            for h in handles:
                state.loop.abort(h)
    if work.cancelled():
        raise APIError(499, "the client closed the request", code="client_closed")
    work.result()


async def _stream(state: ServeState, maker: ChunkMaker, handles, by_id, choices, prompt_lens):
    queue = handles[0].queue
    try:
        if maker.chat:
            for c in choices:
                yield sse(maker.role(c.index))
        left = len(handles)
        while left:
            item = await queue.get()
            if isinstance(item, EngineFailed):
                yield sse(APIError(500, str(item), "server_error").body())
                break
            choice = by_id[item.request_id][1]
            choice.add(item)
            left -= item.finish_reason is not None
            chunk = maker.delta(choice, item)
            if chunk is not None:
                yield sse(chunk)
        else:
            if maker.include_usage:
                yield sse(maker.usage(prompt_lens, choices))
        yield SSE_DONE
    finally:  # (also when Starlette cancels the stream because the client went away)
        for h in handles:
            state.loop.abort(h)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------- errors
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return JSONResponse(_validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed"}
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            APIError(500, f"internal server error ({type(exc).__name__})", "server_error").body(), status_code=500
        )


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field (`param`)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    kind, msg = e.get("type", ""), e.get("msg", "invalid value")
    if kind == "extra_forbidden":
        message = f"unknown field '{'.'.join(loc)}'"
    elif kind == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif not loc and kind in ("model_attributes_type", "dict_type"):
        message = "the request body must be a JSON object"
    elif kind == "missing":
        message = f"missing required field '{'.'.join(loc)}'"
    else:
        message = msg.removeprefix("Value error, ")
        if loc:
            message = f"{'.'.join(loc[:1])}: {message}"
    return APIError(400, message, param=param)
