"""`pdserve serve`: the OpenAI-compatible server (a FastAPI frontend plus engine worker processes)."""

from __future__ import annotations

import argparse
import logging

from pdserve.commands.engine_args import add_engine_arguments, engine_args_from
from pdserve.config import RequestLimits

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
    s.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "mistral"],
        default="auto",
        help="how tool calls are read from the model's text (auto: from the chat template and "
        "the architecture: Qwen -> hermes, Llama -> llama3_json, Mistral -> mistral)",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key: serve /metrics without the key (default: /metrics needs it)",
    )
    lim = p.add_argument_group(
        "request limits (each checked before any work; a 400 beyond, 413/431 for sizes)"
    )
    lim.add_argument(
        "--max-body-bytes", type=int, default=16 << 20, help="413 above this body size (16 MiB)"
    )
    lim.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 << 10,
        help="431 above this size of request line plus headers (64 KiB)",
    )
    defaults = RequestLimits()
    for flag, name, what in (
        ("--max-n", "max_n", "completions per prompt (n, best_of)"),
        ("--max-prompts", "max_prompts", "prompts in one /v1/completions request"),
        ("--max-sequences", "max_sequences", "completions in one request (prompts x n)"),
        ("--max-stop", "max_stop", "stop strings per request"),
        ("--max-logprobs", "max_logprobs", "logprobs / top_logprobs"),
    ):
        default = getattr(defaults, name)
        lim.add_argument(flag, type=int, default=default, help=f"most {what} ({default})")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--cpus", help="colocated: CPU set of the worker, e.g. 0-1")
    add_engine_arguments(p)

    d = p.add_argument_group("disaggregation (prefill and decode worker pools)")
    d.add_argument(
        "--mode",
        choices=["colocated", "disagg"],
        help="default: disagg when --prefill-workers >= 1, else colocated",
    )
    d.add_argument("--prefill-workers", type=int, default=0, metavar="P")
    d.add_argument("--decode-workers", type=int, default=1, metavar="D")
    d.add_argument(
        "--kv-transport",
        choices=["shm", "tcp"],
        default="shm",
        help="how KV moves from prefill to decode workers (default: shm, one host)",
    )
    d.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="address decode workers bind their TCP KV channel to (default: 127.0.0.1)",
    )
    d.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="recompute on the decode worker if the KV has not arrived by then",
    )
    d.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="prefill prompts shorter than N on the decode worker itself",
    )
    d.add_argument(
        "--on-prefill-failure",
        choices=["recompute", "fail"],
        default="recompute",
        help="a dead prefill worker: recompute on the decode worker, or fail with 503",
    )
    d.add_argument(
        "--restart-workers",
        action="store_true",
        help="start a dead worker again; it rejoins its pool",
    )
    d.add_argument(
        "--prefill-cpus",
        action="append",
        default=[],
        help="CPU set of a prefill worker (repeat per worker), e.g. 0",
    )
    d.add_argument(
        "--decode-cpus",
        action="append",
        default=[],
        help="CPU set of a decode worker (repeat per worker), e.g. 1",
    )
    for pool in ("prefill", "decode"):
        for opt, typ in POOL_OPTIONS:
            d.add_argument(
                f"--{pool}-{opt}", type=typ, metavar="N", help=f"{pool} pool only: --{opt}"
            )


POOL_OPTIONS = [
    ("max-num-batched-tokens", int),
    ("max-num-seqs", int),
    ("long-prefill-token-threshold", int),
    ("kv-cache-memory", str),
    ("num-kv-blocks", int),
    ("block-size", int),
]


def disagg_config_from(args: argparse.Namespace):
    from pdserve.config import DisaggConfig

    if args.mode == "disagg" and args.prefill_workers < 1:
        raise ValueError("invalid --mode disagg: needs --prefill-workers >= 1")
    if args.mode == "colocated" and args.prefill_workers:
        raise ValueError("invalid --mode colocated with --prefill-workers")
    overrides = {}
    for pool in ("prefill", "decode"):
        overrides[pool] = {
            opt.replace("-", "_"): getattr(args, f"{pool}_{opt.replace('-', '_')}")
            for opt, _ in POOL_OPTIONS
            if getattr(args, f"{pool}_{opt.replace('-', '_')}") is not None
        }
    return DisaggConfig(
        num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers,
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        min_prompt_tokens=args.disagg_min_prompt_tokens,
        on_prefill_failure=args.on_prefill_failure,
        prefill_cpus=tuple(args.prefill_cpus),
        decode_cpus=tuple(args.decode_cpus or ([args.cpus] if args.cpus else [])),
        prefill_overrides=overrides["prefill"],
        decode_overrides=overrides["decode"],
        restart_workers=args.restart_workers,
    )


def server_config_from(args: argparse.Namespace):
    import os

    from pdserve.config import ServerConfig

    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        max_waiting_requests=args.max_waiting_requests,
        queue_timeout_s=args.queue_timeout,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        public_metrics=args.public_metrics,
        tool_call_parser=args.tool_call_parser,
        limits=RequestLimits(
            max_n=args.max_n,
            max_prompts=args.max_prompts,
            max_sequences=args.max_sequences,
            max_stop=args.max_stop,
            max_logprobs=args.max_logprobs,
        ),
    )


def bind(host: str, port: int):
    """The listening socket, bound before the model loads: a taken port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it small responses wait ~40 ms for delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"invalid --port {port}: cannot listen on {host}:{port} ({e.strerror})"
        ) from None
    return sock


def run(args: argparse.Namespace) -> int:
    config = server_config_from(args)  # bad options, a missing model or a taken port fail
    engine_args = engine_args_from(args)  # here, before the slow imports and the model load
    disagg = disagg_config_from(args)
    sock = bind(config.host, config.port)

    import uvicorn

    from pdserve.frontend.api import build_app
    from pdserve.frontend.guard import GuardedH11Protocol

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    app = build_app(engine_args, config, disagg=disagg)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=10,
            http=GuardedH11Protocol,
            h11_max_incomplete_event_size=config.max_header_bytes,
        )
    )
    server.run(sockets=[sock])
    return 0
