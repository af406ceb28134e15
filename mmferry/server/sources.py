"""OpenAI-style content parts -> checked media bytes (data: URLs, allowed paths, allowed hosts).

Everything a client sends is checked here before any pixel is decoded: the part's shape, its
content type, the base64, where a path or URL points, and the size, pixel and frame limits
read from the file's header.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mmferry.server.limits import Limits, RequestError, over_limit, too_large

PART_TYPES = {"image_url": "image", "video_url": "video"}


@dataclass(frozen=True)
class Media:
    """One part's bytes, its modality and a short name for messages."""

    modality: str
    data: bytes
    name: str


def _bad(message: str, status: int = 422, kind: str = "bad_request") -> RequestError:
    return RequestError(status, kind, message)


def parse_request(body: Any, limits: Limits) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(modality, url) per part, and the options; 422 for anything malformed."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object with a 'content' list")
    content = body.get("content")
    if content is None:
        raise _bad("missing field 'content' (a list of image_url / video_url parts)")
    if not isinstance(content, list):
        raise _bad("'content' must be a list of parts")
    parts: list[tuple[str, str]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise _bad(f"part {i} must be an object with a 'type'")
        kind = part["type"]
        if kind == "text":
            continue  # chat messages mix text in; it has nothing to encode
        if kind not in PART_TYPES:
            raise _bad(f"part {i} has unknown type {kind!r}; expected image_url or video_url")
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise _bad(f"part {i} ({kind}) is missing field '{kind}.url'")
        parts.append((PART_TYPES[kind], url))
    if not parts:
        raise _bad("'content' has no image_url or video_url part")
    if len(parts) > limits.max_items:
        raise over_limit(
            f"the number of parts ({len(parts)})", len(parts), "max_items", limits.max_items
        )
    options = {k: v for k, v in body.items() if k != "content"}
    return parts, options


def _data_url(url: str, modality: str, index: int, limits: Limits) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise _bad(f"part {index}: a data: URL needs a ',' before its payload", 400)
    mime, *params = head[len("data:") :].split(";")
    if not mime.startswith(f"{modality}/"):
        raise RequestError(
            415,
            "content_type",
            f"part {index}: its {modality}_url carries content type {mime or '(none)'!r}; "
            f"expected {modality}/*",
        )
    if "base64" not in params:
        raise _bad(f"part {index}: only base64 data: URLs are accepted", 400)
    if len(payload) * 3 // 4 > limits.max_request_bytes:
        raise too_large(
            f"part {index}", len(payload) * 3 // 4, "max_request_bytes", limits.max_request_bytes
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(
            f"part {index}: invalid base64 in the data: URL ({e})", 400, "bad_base64"
        ) from None


def _local(url: str, index: int, limits: Limits) -> tuple[bytes, str]:
    raw = unquote(urlsplit(url).path) if url.startswith("file:") else url
    path = Path(os.path.realpath(raw))
    # NOTE: realpath first, so '..' and symlinks cannot step out of an allowed folder.
    roots = [Path(os.path.realpath(r)) for r in limits.allow_paths]
    if not any(path == r or r in path.parents for r in roots):
        where = ", ".join(str(r) for r in roots) or "none (start the server with --allow-path)"
        raise RequestError(
            403, "forbidden_path", f"part {index}: {raw} is outside the allowed folders: {where}"
        )
    if not path.is_file():
        raise RequestError(404, "not_found", f"part {index}: no such file {raw}")
    size = path.stat().st_size
    if size > limits.max_request_bytes:
        raise too_large(
            f"part {index} ({raw})", size, "max_request_bytes", limits.max_request_bytes
        )
    return path.read_bytes(), path.name


def _remote(url: str, index: int, limits: Limits) -> bytes:
    split = urlsplit(url)
    host = split.hostname or ""
    hostport = f"{host}:{split.port}" if split.port else host
    if host not in limits.allow_hosts and hostport not in limits.allow_hosts:
        raise RequestError(
            403,
            "forbidden_url",
            f"part {index}: remote URLs are refused unless the host is allowed (--allow-host); "
            f"{hostport!r} is not",
        )
    import httpx

    data = bytearray()
    try:
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False) as r:
            if r.status_code != 200:
                raise RequestError(
                    502, "fetch_failed", f"part {index}: {url} answered {r.status_code}"
                )
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > limits.max_request_bytes:
                    raise too_large(
                        f"part {index} ({url})",
                        len(data),
                        "max_request_bytes",
                        limits.max_request_bytes,
                    )
    except httpx.HTTPError as e:
        raise RequestError(
            502, "fetch_failed", f"part {index}: fetching {url} failed ({e})"
        ) from None
    return bytes(data)


def fetch(modality: str, url: str, index: int, limits: Limits) -> Media:
    """The bytes a part names, checked against the allowed sources and the byte limit."""
    scheme = urlsplit(url).scheme.lower() if ":" in url[:12] else ""
    if scheme == "data":
        return Media(modality, _data_url(url, modality, index, limits), f"part {index}")
    if scheme in ("http", "https"):
        return Media(modality, _remote(url, index, limits), f"part {index}")
    if scheme == "file" or (not scheme and url.startswith("/")):
        data, name = _local(url, index, limits)
        return Media(modality, data, f"part {index} ({name})")
    raise _bad(f"part {index}: unsupported URL {url[:40]!r}; use data:, file:, a path or http(s)")


def check_media(media: Media, limits: Limits) -> None:
    """Pixel and frame limits from the header, before any decoding (422); 422 if unreadable."""
    if media.modality == "image":
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(media.data)) as im:
                w, h = im.size
        except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
            raise _bad(
                f"{media.name}: cannot decode image: not a readable image ({e})", 422, "bad_media"
            ) from None
        if w * h > limits.max_pixels:
            raise over_limit(
                f"{media.name}: {w}x{h} pixels", w * h, "max_pixels", limits.max_pixels
            )
        return
    from mmferry.preprocess.video_decode import probe_video

    try:
        info = probe_video(media.data, media.name)
    except ValueError as e:
        raise _bad(str(e), 422, "bad_media") from None
    if info.height * info.width > limits.max_pixels:
        raise over_limit(
            f"{media.name}: frames of {info.width}x{info.height} pixels",
            info.height * info.width,
            "max_pixels",
            limits.max_pixels,
        )
    if info.total_frames > limits.max_frames:
        raise over_limit(
            f"{media.name}: the frame count", info.total_frames, "max_frames", limits.max_frames
        )
