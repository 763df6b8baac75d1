"""`pdserve serve`: the OpenAI-compatible server (a FastAPI frontend plus engine worker processes)."""

from __future__ import annotations

import argparse
import logging
import os

from pdserve.commands.engine_args import add_engine_arguments, engine_args_from
from pdserve.commands.flags import Groups, add_flags, add_pool_flags, from_args, pool_overrides
from pdserve.config.disagg import DISAGG_GROUP, DisaggConfig
from pdserve.config.engine import EngineArgs
from pdserve.config.profiles import PROFILES
from pdserve.config.server import LIMITS_GROUP, RequestLimits, ServerConfig

HELP = "serve a model over an OpenAI-compatible HTTP API"


def add_arguments(p: argparse.ArgumentParser) -> None:
    groups: Groups = {}
    add_flags(p, ServerConfig, "server", groups)
    add_flags(p, RequestLimits, LIMITS_GROUP, groups)
    s = groups["server"]
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--cpus", help="colocated: CPU set of the worker, e.g. 0-1")
    add_engine_arguments(p)
    d = groups[DISAGG_GROUP] = p.add_argument_group(DISAGG_GROUP)
    d.add_argument(
        "--mode",
        choices=["colocated", "disagg"],
        help="default: disagg when --prefill-workers >= 1, else colocated",
    )
    add_flags(p, DisaggConfig, DISAGG_GROUP, groups)
    add_pool_flags(d, EngineArgs)


def profile_defaults(args: argparse.Namespace) -> dict:
    """`--profile NAME`: its settings become the defaults (`pdserve.config.profiles`)."""
    return dict(PROFILES[args.profile]) if args.profile else {}


def disagg_config_from(args: argparse.Namespace) -> DisaggConfig:
    if args.mode == "disagg" and args.num_prefill_workers < 1:
        raise ValueError("invalid --mode disagg: needs --prefill-workers >= 1")
    if args.mode == "colocated" and args.num_prefill_workers:
        raise ValueError("invalid --mode colocated with --prefill-workers")
    return from_args(
        DisaggConfig,
        args,
        decode_cpus=args.decode_cpus or ([args.cpus] if args.cpus else []),
        prefill_overrides=pool_overrides(EngineArgs, args, "prefill"),
        decode_overrides=pool_overrides(EngineArgs, args, "decode"),
    )


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    return from_args(
        ServerConfig,
        args,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        limits=from_args(RequestLimits, args),
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
    from pdserve.heap import freeze_startup_heap
    from pdserve.ipc import sched_slice

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # the workers read it from the environment they inherit
    os.environ[sched_slice.ENV_VAR] = "1" if config.short_time_slices else "0"
    # the threads that carry tokens out: before any is started
    if config.short_time_slices and not sched_slice.shorten_process():
        logging.getLogger(__name__).warning(
            "--short-time-slices: this system grants no per-thread scheduler slices (Linux 6.12 "
            "or later has them); every thread keeps the default"
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
    freeze_startup_heap()  # what startup built lives as long as the server: out of GC's walks
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        return 130
    return 0
