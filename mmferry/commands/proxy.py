"""`mmferry proxy`: the encode/prefill/decode front in front of an OpenAI-compatible vLLM.

Chat completions have their images and videos encoded by the `mmferry serve` encoders (each
item on the encoder its hash routes to, failing over to its next choices) and rewritten for the
engine: grid-and-uuid parts for a vLLM whose `MmferryECConnector` loads the rows from the
encoders (--mode connector), or embedding parts carrying the rows (--mode embeds, for
`--enable-mm-embeds`). Items no encoder can serve go to the engine as their pixels (when vLLM
reads them as the encoder did; else a 503). Other routes vLLM reads media from are refused
unless passed (--pass-route). Everything else passes through unchanged, and answers stream
back as they come. Keys come from the environment: MMFERRY_API_KEY (what clients send),
MMFERRY_ENCODER_API_KEY (sent to the encoders), MMFERRY_LLM_API_KEY (sent to the engine;
unset: the client's own header passes). SIGTERM or Ctrl-C drains and exits 0.
"""

from __future__ import annotations

import argparse
import sys

from mmferry.commands.serve import add_intake_args, add_log_level, port
from mmferry.routing import EPSILON


def add_args(p: argparse.ArgumentParser) -> None:
    from mmferry.proxy.config import DTYPES, MODES
    from mmferry.server.limits import Limits, option

    lim = Limits()
    p.add_argument("--llm", required=True, metavar="URL", help="the engine's OpenAI server")
    p.add_argument(
        "--encoder",
        action="append",
        required=True,
        metavar="URL",
        help="an `mmferry serve` encoder (repeatable; order does not matter)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="connector",
        help="connector: grid-and-uuid parts for vLLM's MmferryECConnector; embeds: the rows "
        "through the proxy, for --enable-mm-embeds",
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="embeds mode: the engine's dtype"
    )
    p.add_argument(
        "--encode-ahead",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="connector mode: the encoders answer once the items are preprocessed and the "
        "engine reads the request while their towers run (its connector waits for the rows); "
        "for towers on GPUs with CPU cores to spare: where the engine and the encoders share "
        "cores, the engine polling for its next step while it waits slows the towers "
        "(default: off, the request goes to the engine once its rows are held)",
    )
    p.add_argument(
        "--name-ahead",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="connector mode: the proxy names each image sent as a data: URL itself (its hash "
        "and grid, from its header and the encoders' settings) and sends the request to the "
        "engine beside the encode rather than after it; the engine's connector waits for the "
        "rows. Off by default: the engine waiting beside the encoders costs them CPU where they "
        "share cores",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: this host only)")
    p.add_argument("--port", type=port, default=8080, help="0 picks a free port (printed)")
    p.add_argument(
        "--max-in-flight", type=int, default=256, metavar="N", help="requests; 503 past it"
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=EPSILON,
        help="bounded load: an encoder past (1 + epsilon) x the mean in-flight items passes "
        "new items to their next choice (a guard for a slow encoder; hot keys are spread apart)",
    )
    p.add_argument(
        "--encoder-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="a whole call to an encoder (an encode, or a load of rows)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="an encoder or the engine not accepting the connection within this is down",
    )
    p.add_argument(
        "--llm-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="the engine's silence between two chunks of an answer",
    )
    p.add_argument(
        option("max_request_bytes"),
        type=int,
        default=lim.max_request_bytes,
        dest="limit_request_bytes",
        metavar="N",
        help="the body; 413 past it",
    )
    p.add_argument(
        option("max_items"),
        type=int,
        default=lim.max_items,
        dest="limit_items",
        metavar="N",
        help="images and videos per request; 422 past it",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a host[:port] whose http(s) media URLs are passed on to the encoders "
        "(repeatable; default: none)",
    )
    p.add_argument(
        "--pass-route",
        action="append",
        default=[],
        metavar="PATH",
        help="a route whose body the engine reads media from (/v1/responses, /tokenize, "
        "/v1/embeddings...), passed on unchecked; refused (403) by default (repeatable)",
    )
    p.add_argument(
        "--allow-client-embeds",
        action="store_true",
        help="pass on the *_embeds parts clients send (rows and a uuid the client chose) "
        "instead of refusing them (422)",
    )
    p.add_argument(
        "--private-metrics",
        action="store_true",
        help="/metrics asks for the API key (MMFERRY_API_KEY) as the other routes do; "
        "/health stays open",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="SIGTERM to exit")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S", help="408 past it")
    add_intake_args(p)
    add_log_level(p)


def run(args: argparse.Namespace) -> int:
    """Start the proxy, serve until SIGTERM/SIGINT, drain, exit 0."""
    from mmferry.env import Env
    from mmferry.proxy.app import ProxyState, create_app
    from mmferry.proxy.config import ProxyConfig
    from mmferry.server.app import import_fastapi
    from mmferry.server.limits import Limits
    from mmferry.server.run import import_uvicorn, serve_app

    import_fastapi(), import_uvicorn()
    env = Env.read()
    try:
        config = ProxyConfig(
            llm_url=args.llm,
            encoder_urls=tuple(args.encoder),
            mode=args.mode,
            encode_ahead=args.encode_ahead,
            name_ahead=args.name_ahead,
            dtype=args.dtype,
            limits=Limits(
                max_request_bytes=args.limit_request_bytes,
                max_items=args.limit_items,
                allow_hosts=tuple(args.allow_host),
            ),
            max_in_flight=args.max_in_flight,
            api_key=env.api_key,
            encoder_api_key=env.encoder_api_key,
            llm_api_key=env.llm_api_key,
            epsilon=args.epsilon,
            encoder_timeout_s=args.encoder_timeout,
            connect_timeout_s=args.connect_timeout,
            llm_timeout_s=args.llm_timeout,
            drain_timeout_s=args.drain_timeout,
            body_timeout_s=args.body_timeout,
            header_timeout_s=args.header_timeout,
            max_uploads=args.max_uploads,
            pass_routes=tuple(args.pass_route),
            allow_client_embeds=args.allow_client_embeds,
            private_metrics=args.private_metrics,
        )
        state = ProxyState(config)
    except ValueError as e:
        print(f"mmferry proxy: {e}", file=sys.stderr)
        return 2
    print(
        f"mmferry proxy: {config.mode} mode, engine {config.llm_url}, "
        f"{len(config.encoder_urls)} encoder(s)",
        flush=True,
    )
    app = create_app(config, state)

    def header_timeout() -> None:
        state.metrics.errors.labels("header_timeout").inc()
        state.metrics.requests.labels("other", "408").inc()

    return serve_app(
        app,
        state,
        args.host,
        args.port,
        config.drain_timeout_s,
        name="proxy",
        log_level=args.log_level,
        header_timeout_s=config.header_timeout_s,
        on_header_timeout=header_timeout,
    )
