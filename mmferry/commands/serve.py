"""`mmferry serve`: the HTTP encoder service.

The API key, when one is wanted, comes from the MMFERRY_API_KEY environment variable (kept out
of the command line, which other users can read). SIGTERM or Ctrl-C drains and exits 0.
"""

from __future__ import annotations

import argparse
import sys

from mmferry.commands.model_args import add_model_args, build


def add_args(p: argparse.ArgumentParser) -> None:
    from mmferry.server.limits import Limits
    from mmferry.server.service import ServiceConfig

    d, lim = ServiceConfig(), Limits()
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument(
        "--max-batch-patches",
        type=int,
        default=d.max_batch_patches,
        help="patch budget of one encoder call",
    )
    p.add_argument("--no-batching", action="store_true", help="one item per encoder call")
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait for more before a call")
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="admitted requests (their bodies in); 503 past it (default %(default)s)",
    )
    p.add_argument("--cache-mib", type=int, default=d.cache_bytes >> 20, help="encoder cache")
    p.add_argument(
        "--shm-mib", type=int, default=d.shm_bytes >> 20, help="shared-memory responses (0: off)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=lim.max_request_bytes,
        help="the body, and each file or URL read; 413 past it (default %(default)s)",
    )
    p.add_argument(
        "--max-items",
        type=int,
        default=lim.max_items,
        help="parts per request (default %(default)s)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=lim.max_pixels,
        help="per image or video frame, from the header (default %(default)s)",
    )
    p.add_argument(
        "--max-frames",
        type=int,
        default=lim.max_frames,
        help="frames sampled (so decoded and held) per video, not the file's count "
        "(default %(default)s)",
    )
    p.add_argument(
        "--allow-path", action="append", default=[], metavar="DIR", help="local folder to serve"
    )
    p.add_argument(
        "--allow-host", action="append", default=[], metavar="HOST", help="host[:port] to fetch"
    )
    p.add_argument(
        "--fetch-timeout",
        type=float,
        default=lim.fetch_timeout_s,
        metavar="S",
        help="one remote fetch in all, waiting for a slot included; 504 past it "
        "(default %(default)s)",
    )
    p.add_argument(
        "--fetch-concurrency",
        type=int,
        default=d.fetch_concurrency,
        metavar="N",
        help="remote fetches at once, beside preprocessing (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        metavar="S",
        help="SIGTERM to exit, open requests included (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help="a request body must arrive within this; 408 past it (default %(default)s)",
    )
    p.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Build the tower, start the service, serve until SIGTERM/SIGINT, drain, exit 0."""
    from mmferry.env import Env
    from mmferry.server.app import import_fastapi
    from mmferry.server.limits import Limits
    from mmferry.server.run import import_uvicorn, serve
    from mmferry.server.service import EncoderService, ServiceConfig

    import_fastapi(), import_uvicorn()  # fail before loading a model
    env = Env.read()
    try:
        limits = Limits(
            max_request_bytes=args.max_request_bytes,
            max_items=args.max_items,
            max_pixels=args.max_pixels,
            max_frames=args.max_frames,
            allow_paths=tuple(args.allow_path),
            allow_hosts=tuple(args.allow_host),
            fetch_timeout_s=args.fetch_timeout,
        )
        config = ServiceConfig(
            limits=limits,
            max_batch_patches=0 if args.no_batching else args.max_batch_patches,
            batch_wait_s=args.batch_wait_ms / 1e3,
            max_queue=args.max_queue,
            cache_bytes=args.cache_mib << 20,
            shm_bytes=args.shm_mib << 20,
            api_key=env.api_key,
            drain_timeout_s=args.drain_timeout,
            body_timeout_s=args.body_timeout,
            fetch_concurrency=args.fetch_concurrency,
        )
    except ValueError as e:  # a bad option value: one line, argparse's status
        print(f"mmferry serve: {e}", file=sys.stderr)
        return 2
    leader = None
    if env.world_size > 1:
        from mmferry.server.sharded import ShardedLeader, follow, init_group

        args.device = init_group(args.device, env.world_size, env.local_rank)
    proc, enc = build(args)
    if env.world_size > 1:
        if env.rank != 0:
            return follow(enc)
        leader = ShardedLeader(enc)
    print(f"mmferry serve: {enc!r} on {env.world_size} rank(s)", flush=True)
    service = EncoderService(proc, enc, config, encode=leader)
    try:
        return serve(service, args.host, args.port, log_level=args.log_level)
    finally:
        if leader is not None:
            leader.close()
