"""`redwood serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Engine.

Takes `redwood generate`'s model / speculation / engine flags. Binds 127.0.0.1 unless --host says
otherwise; --port 0 picks a free port (the "serving … on http://HOST:PORT" line names it).

SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish, then the process exits 0; a
second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import sys

from redwood.commands.options import (
    add_engine_args,
    add_model_args,
    add_offload_args,
    add_speculative_args,
    engine_kwargs,
    load_kwargs,
    speculative_config_from_args,
)

log = logging.getLogger("redwood.serve")


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (streaming or not), /v1/models, /health, /metrics "
        "(Prometheus) and a playground page at /. With --draft-model M, "
        "--self-speculate or --draft ngram every request decodes speculatively (lossless).",
    )
    add_model_args(p)
    add_offload_args(p)
    add_speculative_args(p)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    g.add_argument(
        "--api-key", default=None, metavar="KEY", help="require 'Authorization: Bearer KEY' on the /v1 routes"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        metavar="N",
        help="most requests waiting for a batch slot; beyond it requests get 503 (default: no limit)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest request body accepted; larger ones get 413 (default 16 MiB)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's and redwood's log level (default info; info logs every request)",
    )
    p.set_defaults(func=run)


def _check_server_args(args) -> None:
    from redwood.errors import ConfigError

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue is not None and args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.api_key is not None and not args.api_key:
        raise ConfigError("--api-key must not be empty")


def run(args) -> int:
    _check_server_args(args)  # (every flag checked before the slow model load)
    spec = speculative_config_from_args(args)
    loading = load_kwargs(args)  # (the load flags' errors before the server's imports)
    try:
        import uvicorn

        from redwood.serve.app import DEFAULT_MAX_REQUEST_BYTES, create_app
        from redwood.serve.server import DrainingServer
    except ImportError as e:
        from redwood.errors import ConfigError

        raise ConfigError(
            f"redwood serve needs fastapi, uvicorn and prometheus-client ({e}): pip install fastapi uvicorn prometheus-client"
        ) from None
    from redwood.engine.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    engine = Engine.from_pretrained(
        args.model,
        speculative=spec,
        **loading,
        **engine_kwargs(args),
    )
    name = args.served_model_name or str(args.model)
    app = create_app(
        engine,
        served_model_name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=None, lifespan="on"
    )
    server = DrainingServer(config, app.state.redwood, banner=f"serving {name}")
    server.run()
    sys.stdout.flush()
    return 0 if server.started else 1
