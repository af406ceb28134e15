"""`ProxyConfig`: what one `mmferry proxy` process is pointed at and how far it goes."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmferry.proxy.paths import canonical
from mmferry.routing import EPSILON
from mmferry.server.limits import Limits, RequestError

MODES = ("connector", "embeds")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ProxyConfig:
    """Runtime settings of one proxy (`mmferry proxy` options)."""

    llm_url: str
    encoder_urls: tuple[str, ...]
    # connector: grid-and-uuid parts, rows go encoder -> engine; embeds: rows through the proxy.
    mode: str = "connector"
    # Connector mode: ask the encoders to answer once the items are preprocessed and encode
    # behind the answer, so the engine reads the request while the tower runs. Off by default:
    # where the engine and the encoders share CPU cores, vLLM's worker polling for steps while
    # it holds the request takes the towers' CPU (BENCHMARKS.md, heavy runs 4 to 6).
    encode_ahead: bool = False
    # Connector mode: name each image (hash, grid) from its header and the encoders' settings
    # and send the request to the engine beside the encode, not after it (proxy/ahead.py).
    name_ahead: bool = False
    # Embeds mode: the dtype of the rows handed to the engine (its model dtype).
    dtype: str = "bfloat16"
    limits: Limits = field(default_factory=Limits)
    max_in_flight: int = 256  # requests at once; the next one gets 503
    api_key: str | None = None  # what clients must send
    encoder_api_key: str | None = None  # what the proxy sends the encoders
    llm_api_key: str | None = None  # what the proxy sends the engine (None: the client's own)
    epsilon: float = EPSILON  # bounded load: (1 + epsilon) x the mean in-flight items
    encoder_timeout_s: float = 60.0  # a whole encode or load call on one encoder
    connect_timeout_s: float = 2.0  # a refused or silent encoder fails within this
    llm_timeout_s: float = 600.0  # the engine's answer, between two chunks
    probe_interval_s: float = 0.25  # how often down encoders are checked for a due probe
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (408)
    max_uploads: int = 64  # request bodies arriving at once; the next one gets 503
    # Routes whose body the engine reads for media, passed on unchecked (the operator's call).
    pass_routes: tuple[str, ...] = ()
    allow_client_embeds: bool = False  # *_embeds parts a client sends reach the engine
    private_metrics: bool = False  # /metrics asks for the API key as the other routes do

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.encoder_urls:
            raise ValueError("give at least one encoder (--encoder URL)")
        for name in ("max_in_flight", "max_uploads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in (
            "epsilon",
            "encoder_timeout_s",
            "connect_timeout_s",
            "llm_timeout_s",
            "drain_timeout_s",
            "body_timeout_s",
            "header_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.private_metrics and not self.api_key:
            raise ValueError("--private-metrics needs an API key (MMFERRY_API_KEY)")
        try:
            routes = tuple(canonical(r) for r in self.pass_routes)
        except RequestError as e:
            raise ValueError(f"--pass-route: {e.message}") from None
        object.__setattr__(self, "pass_routes", routes)
        object.__setattr__(self, "llm_url", self.llm_url.rstrip("/"))
        object.__setattr__(self, "encoder_urls", tuple(u.rstrip("/") for u in self.encoder_urls))
