"""`mmferry serve`: the HTTP encoder service.

Requests hold content parts or whole chat messages (OpenAI or Qwen form, with qwen-vl-utils'
per-item keys). --min-pixels / --max-pixels, the video ones, --fps and --num-frames resize and
sample as transformers' options of those names do; what one request may hold is set by the
--limit-* options (--limit-pixels is what --max-pixels meant before: the resize budget now).
A part's qwen-vl-utils keys replace the resize options for that part, within them: the size
they give must lie within the budget (--max-pixels, --video-max-pixels).
The API key, when one is wanted, comes from the MMFERRY_API_KEY environment variable (kept out
of the command line, which other users can read). SIGTERM or Ctrl-C drains and exits 0.
"""

from __future__ import annotations

import argparse
import sys

from mmferry.commands import positive_int, quoted
from mmferry.commands.model_args import add_model_args, build


def port(text: str) -> int:
    """argparse type of --port: 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {quoted(text)}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535; 0 picks a free one)")
    return value


# (field of Limits, help); the option is limits.option(field). The old --max-* names stay
# accepted (hidden), except --max-pixels, which is now the resize budget as in transformers.
_LIMITS = (
    ("max_request_bytes", "the body, and each file, data: URL or download; 413 past it"),
    ("max_items", "images and videos per request; 422 past it"),
    ("max_pixels", "pixels of an image or a video frame, read from its header; 422 past it"),
    (
        "max_frames",
        "frames a video is sampled to (so decoded and held), not the file's count; 422 past it",
    ),
)
_OLD_NAMES = {"max_request_bytes", "max_items", "max_frames"}


def add_args(p: argparse.ArgumentParser) -> None:
    from mmferry.server.limits import Limits, option
    from mmferry.server.service import ServiceConfig

    d, lim = ServiceConfig(), Limits()
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this host only)")
    p.add_argument("--port", type=port, default=8000, help="0 picks a free port (printed)")
    p.add_argument(
        "--max-batch-patches",
        type=int,
        default=d.max_batch_patches,
        help="patch budget of one encoder call",
    )
    p.add_argument("--no-batching", action="store_true", help="one item per encoder call")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="CUDA only: pad each encoder call to a token budget (powers of two from 1k patches "
        "to --max-batch-patches) and replay that budget's captured CUDA graph",
    )
    p.add_argument(
        "--cuda-graph-mib",
        type=int,
        default=8192,
        help="with --cuda-graphs: device memory all captured graphs may hold (MiB); a budget "
        "past it runs eagerly",
    )
    p.add_argument(
        "--batch-wait-ms", type=float, default=0.0, help="wait for more items before a call"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="admitted requests (their bodies in); 503 past it",
    )
    p.add_argument(
        "--cache-mib", type=int, default=d.cache_bytes >> 20, help="encoder cache size (MiB)"
    )
    p.add_argument(
        "--shm-mib",
        type=int,
        default=d.shm_bytes >> 20,
        help="shared memory for shm responses (MiB; 0: off)",
    )
    for field, text in _LIMITS:
        dest = "limit_" + field.removeprefix("max_")
        p.add_argument(
            option(field), type=int, default=getattr(lim, field), dest=dest, metavar="N", help=text
        )
        if field in _OLD_NAMES:
            p.add_argument(
                "--" + field.replace("_", "-"),
                type=int,
                dest=dest,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    p.add_argument(
        "--allow-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder whose files clients may name (repeatable; default: none)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a host[:port] whose http(s) URLs are fetched (repeatable; default: none)",
    )
    p.add_argument(
        "--fetch-timeout",
        type=float,
        default=lim.fetch_timeout_s,
        metavar="S",
        help="one remote fetch in all, waiting for a slot included; 504 past it",
    )
    p.add_argument(
        "--preprocess-threads",
        type=positive_int,
        metavar="N",
        help="parts preprocessed at once, across requests (default: MMFERRY_PREPROCESS_THREADS, "
        "else this machine's cores)",
    )
    p.add_argument(
        "--encoder-workers",
        type=positive_int,
        metavar="N",
        help="encoder calls at once, the intra-op threads split among them (default: one per "
        "thread on a CPU tower, one on a GPU)",
    )
    p.add_argument(
        "--fetch-concurrency",
        type=int,
        default=d.fetch_concurrency,
        metavar="N",
        help="remote fetches at once, beside preprocessing",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        metavar="S",
        help="SIGTERM to exit, open requests included",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help="a request body must arrive within this; 408 past it",
    )
    p.add_argument(
        "--sglang-connect-timeout",
        type=float,
        default=d.sglang_connect_s,
        metavar="S",
        help="SGLang's /encode: the connection to the receive address it names must be up within "
        "this (it is made while the part encodes), else 502 receiver_unreachable at once",
    )
    add_intake_args(p)
    p.add_argument(
        "--store",
        metavar="URL",
        help="share encoder outputs with other services through a Mooncake Store: "
        "mooncake://MASTER_HOST:PORT?metadata=URL (the `mooncake` extra; README)",
    )
    add_log_level(p)


def add_intake_args(p: argparse.ArgumentParser) -> None:
    """--max-uploads and --header-timeout, what every request's intake obeys (`serve` and
    `proxy`; server/intake.py and server/protocol.py)."""
    from mmferry.server.service import ServiceConfig

    d = ServiceConfig()
    p.add_argument(
        "--max-uploads",
        type=int,
        default=d.max_uploads,
        help="request bodies arriving at once; 503 past it",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        metavar="S",
        help="a request's headers must arrive within this; 408 past it",
    )


def add_log_level(p: argparse.ArgumentParser) -> None:
    """--log-level, uvicorn's (`serve` and `proxy`)."""
    p.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level",
    )


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
            max_request_bytes=args.limit_request_bytes,
            max_items=args.limit_items,
            max_pixels=args.limit_pixels,
            max_frames=args.limit_frames,
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
            sglang_connect_s=args.sglang_connect_timeout,
            body_timeout_s=args.body_timeout,
            header_timeout_s=args.header_timeout,
            max_uploads=args.max_uploads,
            fetch_concurrency=args.fetch_concurrency,
            preprocess_threads=args.preprocess_threads,
            encoder_workers=args.encoder_workers,
            store=args.store,
            model=args.model or f"random-{args.random}",
        )
        if args.store is not None:  # a bad address or a missing extra, before the model loads
            from mmferry.store.mooncake import StoreAddress, import_mooncake

            StoreAddress.parse(args.store)
            import_mooncake()
    except (ValueError, ImportError) as e:  # a bad option value: one line, argparse's status
        print(f"mmferry serve: {e}", file=sys.stderr)
        return 2
    leader = None
    if env.world_size > 1:
        from mmferry.server.sharded import ShardedLeader, follow, init_group

        args.device = init_group(args.device, env.world_size, env.local_rank)
    proc, enc = build(args)
    if not proc.native and env.world_size > 1:
        # NOTE: the sharded encode splits a native tower's work; it knows no transformers model.
        print(
            "mmferry serve: torchrun (several ranks) serves native families only; "
            f"{args.model} is read through the generic family",
            file=sys.stderr,
        )
        return 2
    if env.world_size > 1:
        if env.rank != 0:
            return follow(enc)
        leader = ShardedLeader(enc)
    print(f"mmferry serve: {enc!r} on {env.world_size} rank(s)", flush=True)
    service = EncoderService(proc, enc, config, encode=leader)
    if service.store is not None:
        print(f"mmferry serve: encoder outputs shared through {service.store!r}", flush=True)
    try:
        return serve(service, args.host, args.port, log_level=args.log_level)
    finally:
        if leader is not None:
            leader.close()
