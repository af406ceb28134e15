"""What the service accepts: the operator's limits and the error every refusal raises."""

from __future__ import annotations

from dataclasses import dataclass


class RequestError(Exception):
    """A refused request: the HTTP status, a machine-readable kind and a message for people."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Per-request bounds and the sources the operator allows."""

    max_request_bytes: int = 32 << 20  # body, and each file or URL read (413)
    max_items: int = 16  # image and video parts per request (422)
    max_pixels: int = 40_000_000  # width*height of an image or a video frame, from headers (422)
    max_frames: int = 3_600  # frames in a video container (422)
    allow_paths: tuple[str, ...] = ()  # folders local paths must resolve into
    allow_hosts: tuple[str, ...] = ()  # "host" or "host:port" that http(s) URLs may name
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_items", "max_pixels", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def too_large(what: str, size: int, limit_name: str, limit: int) -> RequestError:
    """413 naming the byte limit that `what` passed."""
    return RequestError(413, "too_large", f"{what} is {size} bytes, more than {limit_name}={limit}")


def over_limit(what: str, value: int, limit_name: str, limit: int) -> RequestError:
    """422 naming the limit (items, pixels, frames) that `what` passed."""
    return RequestError(422, "over_limit", f"{what} is {value}, more than {limit_name}={limit}")
