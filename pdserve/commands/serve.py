"""`pdserve serve`: the OpenAI-compatible server (a FastAPI frontend plus engine worker processes)."""

from __future__ import annotations

import argparse
import logging

from pdserve.commands.engine_args import add_engine_arguments, engine_args_from

HELP = "serve a model over an OpenAI-compatible HTTP API"


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1; use 0.0.0.0 to expose it)",
    )
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PDSERVE_API_KEY if set)",
    )
    s.add_argument("--served-model-name", help="model id clients send (default: the --model path)")
    s.add_argument(
        "--chat-template", metavar="FILE", help="Jinja chat template overriding the tokenizer's"
    )
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        help="answer 503 when this many requests wait for their first token",
    )
    s.add_argument(
        "--queue-timeout",
        type=float,
        metavar="SECONDS",
        help="end a request with 503 if it is not scheduled within this time",
    )
    s.add_argument("--max-body-bytes", type=int, default=16 << 20, help="413 above this body size")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from pdserve.config import ServerConfig
    from pdserve.server.api import build_app

    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        max_waiting_requests=args.max_waiting_requests,
        queue_timeout_s=args.queue_timeout,
        max_body_bytes=args.max_body_bytes,
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    app = build_app(engine_args_from(args), config)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    return 0
