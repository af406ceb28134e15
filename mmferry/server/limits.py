"""What the service accepts: the operator's limits and the error every refusal raises."""

from __future__ import annotations

from dataclasses import dataclass

from mmferry.chat.sources import shown

__all__ = ["Limits", "RequestError", "named", "option", "over_limit", "shown", "too_large"]


class RequestError(Exception):
    """A refused request: the HTTP status, a machine-readable kind and a message for people."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Per-request bounds and the sources the operator allows (`mmferry serve --limit-*`)."""

    max_request_bytes: int = 32 << 20  # body, and each file or URL read (413)
    max_items: int = 16  # image and video parts per request (422)
    max_pixels: int = 40_000_000  # width*height of an image or a video frame, from headers (422)
    # Frames a video is sampled to (and decoded and held), as the processor samples it (422).
    max_frames: int = 3_600
    allow_paths: tuple[str, ...] = ()  # folders local paths must resolve into
    allow_hosts: tuple[str, ...] = ()  # "host" or "host:port" that http(s) URLs may name
    fetch_timeout_s: float = 15.0  # one remote fetch, waiting for a fetch slot included (504)

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_items", "max_pixels", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({option(name)}) must be at least 1")
        if not self.fetch_timeout_s > 0:
            raise ValueError("fetch_timeout_s must be positive")
        # NOTE: host names are case-insensitive; URLs are matched in lower case.
        object.__setattr__(self, "allow_hosts", tuple(h.lower() for h in self.allow_hosts))


# A limit's field -> the `mmferry serve` option that sets it. The limits have a prefix of their
# own, so that --max-pixels (and --min-pixels) mean the resize budget, as in transformers.
OPTIONS = {
    "max_request_bytes": "--limit-request-bytes",
    "max_items": "--limit-items",
    "max_pixels": "--limit-pixels",
    "max_frames": "--limit-frames",
    "allow_paths": "--allow-path",
    "allow_hosts": "--allow-host",
    # The resize budgets a part's qwen-vl-utils keys are held to (the processor's settings).
    "image_max_pixels": "--max-pixels",
    "video_max_pixels": "--video-max-pixels",
}


def option(limit_name: str) -> str:
    """The `mmferry serve` option that sets a limit: max_pixels -> --limit-pixels."""
    return OPTIONS.get(limit_name) or "--" + limit_name.replace("_", "-")


def named(limit_name: str, limit: int) -> str:
    """A limit as refusals name it: max_pixels -> 'limit_pixels=N (--limit-pixels)'."""
    flag = option(limit_name)
    return f"{flag[2:].replace('-', '_')}={limit} ({flag})"


def too_large(what: str, size: int, limit_name: str, limit: int) -> RequestError:
    """413 naming the byte limit that `what` passed, and its option."""
    return RequestError(
        413,
        "too_large",
        f"{what} is {size} bytes, more than {named(limit_name, limit)}",
    )


def over_limit(what: str, value: int, limit_name: str, limit: int) -> RequestError:
    """422 naming the limit (items, pixels, frames) that `what` passed, and its option."""
    return RequestError(
        422,
        "over_limit",
        f"{what} is {value}, more than {named(limit_name, limit)}",
    )
