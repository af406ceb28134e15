"""OpenAI-style content parts -> checked media bytes (data: URLs, allowed paths, allowed hosts).

Everything a client sends is checked here before any pixel is decoded: the part's shape, its
content type, the base64, where a path or URL points (remote.py fetches the allowed URLs), and
the size, pixel and frame limits read from the file's header.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from PIL import Image

from mmferry.config import ProcessorConfig
from mmferry.server.limits import Limits, RequestError, over_limit, shown, too_large

PART_TYPES = {"image_url": "image", "video_url": "video"}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never valid in a URL (RFC 3986)


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
        if not isinstance(kind, str) or kind not in PART_TYPES:
            raise _bad(f"part {i} has unknown type {shown(kind)}; expected image_url or video_url")
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
    # NOTE: media types and their parameters are case-insensitive (RFC 2045, RFC 2397).
    mime, *params = (p.strip().lower() for p in head[len("data:") :].split(";"))
    if not mime.startswith(f"{modality}/"):
        raise RequestError(
            415,
            "content_type",
            f"part {index}: its {modality}_url carries content type {shown(mime or '(none)')}; "
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


def _bad_url(index: int, why: str) -> RequestError:
    return RequestError(400, "bad_url", f"part {index}: {why}")


def _unreadable(e: OSError, raw: str, index: int) -> RequestError:
    """The refusal for a path the file system will not open."""
    name = shown(raw, 80)
    if e.errno == errno.ENAMETOOLONG:
        return _bad_url(index, f"the path {name} is too long for a file name ({e.strerror})")
    if e.errno in (errno.EACCES, errno.EPERM):
        return RequestError(403, "forbidden_path", f"part {index}: {name} is not readable")
    return RequestError(404, "not_found", f"part {index}: no such file {name} ({e.strerror})")


def _read_file(path: Path, raw: str, index: int, limit: int) -> bytes:
    # NOTE: one open file is checked and read, so the size checked is the size read; O_NONBLOCK
    # keeps a FIFO placed in an allowed folder from blocking the open.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(
                404, "not_found", f"part {index}: {shown(raw, 80)} is not a regular file"
            )
        if st.st_size > limit:
            raise too_large(
                f"part {index} ({shown(raw, 80)})", st.st_size, "max_request_bytes", limit
            )
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since the check
        raise too_large(f"part {index} ({shown(raw, 80)})", len(data), "max_request_bytes", limit)
    return data


def _local(url: str, scheme: str, index: int, limits: Limits) -> tuple[bytes, str]:
    raw = unquote(_split(url, index).path) if scheme == "file" else url
    if "\0" in raw:
        raise _bad_url(index, "a path cannot hold a NUL byte (or %00)")
    try:
        path = Path(os.path.realpath(raw))
        # NOTE: realpath first, so '..' and symlinks cannot step out of an allowed folder.
        roots = [Path(os.path.realpath(r)) for r in limits.allow_paths]
        if not any(path == r or r in path.parents for r in roots):
            where = ", ".join(str(r) for r in roots) or "none (start the server with --allow-path)"
            raise RequestError(
                403,
                "forbidden_path",
                f"part {index}: {shown(raw, 80)} is outside the allowed folders: {where}",
            )
        return _read_file(path, raw, index, limits.max_request_bytes), path.name
    except OSError as e:
        raise _unreadable(e, raw, index) from None


def _split(url: str, index: int) -> SplitResult:
    """`url` split into its parts; 400 for one that no client library would send."""
    control = _CONTROL.search(url)
    if control:
        raise _bad_url(
            index,
            f"the URL has a control character {control.group()!r} at position {control.start()}",
        )
    try:
        split = urlsplit(url)
        split.port  # noqa: B018 - parsed on access: raises for a port that is not a number
    except ValueError as e:
        raise _bad_url(index, f"malformed URL {shown(url)} ({e})") from None
    return split


def remote_url(url: str, index: int, limits: Limits) -> str:
    """`url` if it is an http(s) URL naming an allowed host: 400 if malformed, else 403."""
    split = _split(url, index)
    host = split.hostname or ""
    if not host:
        raise _bad_url(index, f"the URL {shown(url)} names no host")
    # IPv6 hosts are allowed as "::1", "[::1]" or "[::1]:8000".
    named = (host, f"[{host}]") if ":" in host else (host,)
    if split.port is not None:
        named += tuple(f"{n}:{split.port}" for n in named[-1:])
    if not any(n in limits.allow_hosts for n in named):
        raise RequestError(
            403,
            "forbidden_url",
            f"part {index}: remote URLs are refused unless the host is allowed (--allow-host); "
            f"{shown(named[-1])} is not",
        )
    return url


def url_scheme(url: str) -> str:
    """The URL's scheme in lower case (schemes are case-insensitive); '' for a plain path."""
    found = _SCHEME.match(url)
    return found.group(1).lower() if found else ""


def local_media(modality: str, url: str, index: int, limits: Limits) -> Media:
    """The bytes a data: URL or local path names, checked against the allowed folders and the
    byte limit. http(s) URLs are fetched by remote.py (after `remote_url`)."""
    scheme = url_scheme(url)
    if scheme == "data":
        return Media(modality, _data_url(url, modality, index, limits), f"part {index}")
    if scheme == "file" or (not scheme and url.startswith("/")):
        data, name = _local(url, scheme, index, limits)
        return Media(modality, data, f"part {index} ({shown(name, 40)})")
    raise _bad(
        f"part {index}: unsupported URL {shown(url, 40)}; use data:, file:, a path or http(s)"
    )


def _pillow_limit(name: str, e: Exception, limits: Limits) -> RequestError:
    """422 for an image past Pillow's own decompression-bomb limit, naming --max-pixels."""
    found = re.search(r"\((\d+) pixels\)", str(e))
    pixels = f"{found.group(1)} pixels" if found else "more pixels than Pillow opens"
    hard = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    message = f"{name}: {pixels}, more than max_pixels={limits.max_pixels} (--max-pixels)"
    if limits.max_pixels >= hard:
        message = (
            f"{name}: {pixels}, more than Pillow opens ({hard} pixels), which caps "
            f"max_pixels={limits.max_pixels} (--max-pixels)"
        )
    return RequestError(422, "over_limit", message)


def check_media(media: Media, limits: Limits, cfg: ProcessorConfig) -> None:
    """Pixel and frame limits from the header, before any decoding (422); 422 if unreadable."""
    if media.modality == "image":
        try:
            with Image.open(io.BytesIO(media.data)) as im:
                w, h = im.size
        except Image.DecompressionBombError as e:
            raise _pillow_limit(media.name, e, limits) from None
        except Exception as e:  # noqa: BLE001 - Pillow's header parsers raise many types
            raise _bad(
                f"{media.name}: cannot decode image: not a readable image ({e})", 422, "bad_media"
            ) from None
        if w * h > limits.max_pixels:
            raise over_limit(
                f"{media.name}: {w}x{h} pixels", w * h, "max_pixels", limits.max_pixels
            )
        return
    from mmferry.preprocess.video import sample_indices
    from mmferry.preprocess.video_decode import probe_video

    try:
        info = probe_video(media.data, media.name)
        # NOTE: the bound is on what is decoded and held: the frames the processor samples
        # (padded to whole temporal patches), not the container's count.
        sampled = len(sample_indices(cfg, info.total_frames, info.fps))
    except ValueError as e:
        raise _bad(str(e), 422, "bad_media") from None
    held = sampled + (-sampled % cfg.temporal_patch_size)
    if info.height * info.width > limits.max_pixels:
        raise over_limit(
            f"{media.name}: frames of {info.width}x{info.height} pixels",
            info.height * info.width,
            "max_pixels",
            limits.max_pixels,
        )
    if held > limits.max_frames:
        raise over_limit(
            f"{media.name}: the number of sampled frames (of {info.total_frames} in the file)",
            held,
            "max_frames",
            limits.max_frames,
        )
