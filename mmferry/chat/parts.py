"""Content parts of chat messages -> text for the template and media with their options.

One parser for every form users send, so the library, `mmferry encode` and `mmferry serve` agree:
- OpenAI chat: `{"type": "text", "text"}`, `{"type": "image_url", "image_url": {"url"}}`,
  `{"type": "video_url", "video_url": {"url"}}`; the Responses API's `input_text` and
  `input_image` (`"image_url": "<url>"`).
- transformers / Qwen: `{"type": "image", "image" | "url" | "path" | "base64": ...}`,
  `{"type": "video", "video" | "url" | "path": ...}`, where a value may be a path, a `file:`,
  `data:` or http(s) URL, encoded bytes, a PIL image, an array, or (videos) a list of frames;
  a part without "type" is typed by its media key, as qwen-vl-utils reads it.
- qwen-vl-utils' per-item keys beside the media (`min_pixels`, `fps`, ...; see `IMAGE_KEYS`,
  `VIDEO_KEYS`), checked here and applied in `mmferry.chat.qwen_keys`.

Sources are read under a `SourcePolicy`: a library call reads the paths its caller names and
no network; a service narrows paths to allowed folders and may allow hosts and cap sizes.
Every refusal is one `PartError` (a ValueError) naming the message and the part.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

Modality = Literal["image", "video"]

# qwen-vl-utils' per-item keys, by the modality that reads them.
IMAGE_KEYS = frozenset({"min_pixels", "max_pixels", "resized_height", "resized_width"})
VIDEO_KEYS = IMAGE_KEYS | {
    "fps",
    "nframes",
    "min_frames",
    "max_frames",
    "total_pixels",
    "video_start",
    "video_end",
    # frame lists: the rate they were sampled at, and the source's rate (timestamps)
    "sample_fps",
    "raw_fps",
}
# Part type -> (modality or "text", keys holding the value, most specific first).
PART_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "text": ("text", ("text",)),
    "input_text": ("text", ("text",)),
    "image": ("image", ("image", "url", "path", "base64", "image_url")),
    "image_url": ("image", ("image_url", "url")),
    "input_image": ("image", ("image_url", "url")),
    "video": ("video", ("video", "url", "path", "video_url")),
    "video_url": ("video", ("video_url", "url")),
}


class PartError(ValueError):
    """A content part that cannot be used; `kind` and `status` say why, for a service's reply."""

    def __init__(
        self,
        message: str,
        *,
        kind: str = "bad_part",
        status: int = 422,
        message_index: int | None = None,
        part_index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status
        self.message_index, self.part_index = message_index, part_index


@dataclass(frozen=True)
class SourcePolicy:
    """What a part may make mmferry read.

    - `allow_paths`: None reads any local path the caller names (a library call); a tuple
      reads only files under those folders (after resolving links and '..').
    - `allow_hosts`: hosts (or host:port) whose http(s) URLs are fetched; none by default.
    - `max_bytes`: the largest source read, fetched or decoded from a data: URL.
    - `allow_objects`: in-memory sources (PIL images, arrays, bytes) are taken as given.
    - `fetch`: `(url, max_bytes, timeout_s) -> bytes` for allowed hosts (default: urllib,
      no redirects), so a service can use its own client.
    """

    allow_paths: tuple[str, ...] | None = None
    allow_hosts: tuple[str, ...] = ()
    max_bytes: int | None = None
    fetch_timeout_s: float = 30.0
    allow_objects: bool = True
    fetch: Callable[[str, int | None, float], bytes] | None = field(default=None, compare=False)


LIBRARY_POLICY = SourcePolicy()


@dataclass(frozen=True)
class MediaPart:
    """One image or video of a conversation, its source read, with its per-item keys."""

    modality: Modality
    # Encoded bytes, a PIL image, an array / tensor, or (videos) a list of such frames.
    source: Any
    options: Mapping[str, Any]
    message_index: int
    part_index: int

    @property
    def where(self) -> str:
        return f"message {self.message_index} part {self.part_index}"

    def error(self, text: str) -> PartError:
        return PartError(
            f"{self.where} ({self.modality}): {text}",
            message_index=self.message_index,
            part_index=self.part_index,
        )


@dataclass(frozen=True)
class ParsedChat:
    """Messages as the template sees them (parts in Qwen form) and the media in prompt order."""

    messages: list[dict[str, Any]]
    media: list[MediaPart]


def _value(part: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
    for key in keys:
        value = part.get(key)
        if isinstance(value, Mapping) and key.endswith("_url"):
            value = value.get("url")  # OpenAI nests the URL: {"image_url": {"url": ...}}
        if value is not None:
            return key, value
    return None


def _type_of(part: Mapping[str, Any]) -> str | None:
    kind = part.get("type")
    if kind is not None:
        return kind
    # qwen-vl-utils reads parts by their media key; the Qwen templates do too.
    return next((k for k in ("image", "image_url", "video", "text") if k in part), None)


def _check_options(part: Mapping[str, Any], modality: Modality, bad: Callable[..., PartError]):
    allowed = IMAGE_KEYS if modality == "image" else VIDEO_KEYS
    options: dict[str, Any] = {}
    for key in sorted(VIDEO_KEYS & part.keys()):
        value = part[key]
        if key not in allowed:
            raise bad(f"{key!r} is a video option; an image takes {', '.join(sorted(IMAGE_KEYS))}")
        if value is None:
            continue
        low = 0 if key in ("video_start", "video_end") else 1e-9
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
            raise bad(f"{key} must be a {'non-negative' if low == 0 else 'positive'} number")
        options[key] = value
    if "fps" in options and "nframes" in options:
        raise bad("pass either fps or nframes, not both (qwen-vl-utils takes one)")
    if ("resized_height" in options) != ("resized_width" in options):
        raise bad("resized_height and resized_width go together")
    for lo, hi in (("min_pixels", "max_pixels"), ("min_frames", "max_frames")):
        if lo in options and hi in options and options[lo] > options[hi]:
            raise bad(f"{lo} is larger than {hi}")
    return options


def _data_url(url: str, modality: Modality, policy: SourcePolicy, bad: Callable[..., PartError]):
    head, sep, payload = url.partition(",")
    if not sep:
        raise bad("a data: URL needs a ',' before its payload", kind="bad_request", status=400)
    mime, *params = head[len("data:") :].split(";")
    if mime and not mime.startswith(f"{modality}/"):
        raise bad(
            f"its data: URL carries {mime!r}; expected {modality}/*",
            kind="content_type",
            status=415,
        )
    if "base64" not in params:
        raise bad("only base64 data: URLs are accepted", kind="bad_request", status=400)
    return _b64(payload, policy, bad)


def _b64(payload: str, policy: SourcePolicy, bad: Callable[..., PartError]) -> bytes:
    if policy.max_bytes is not None and len(payload) * 3 // 4 > policy.max_bytes:
        raise bad(f"more than {policy.max_bytes} bytes", kind="too_large", status=413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad(f"invalid base64 ({e})", kind="bad_base64", status=400) from None


def _local(raw: str, policy: SourcePolicy, bad: Callable[..., PartError]) -> bytes:
    path = Path(os.path.realpath(raw))
    if policy.allow_paths is not None:
        # NOTE: realpath first, so '..' and symlinks cannot step out of an allowed folder.
        roots = [Path(os.path.realpath(r)) for r in policy.allow_paths]
        if not any(path == r or r in path.parents for r in roots):
            where = ", ".join(str(r) for r in roots) or "none"
            raise bad(
                f"{raw} is outside the allowed folders: {where}",
                kind="forbidden_path",
                status=403,
            )
    if not path.is_file():
        raise bad(f"no such file {raw}", kind="not_found", status=404)
    if policy.max_bytes is not None and path.stat().st_size > policy.max_bytes:
        raise bad(f"{raw} is over {policy.max_bytes} bytes", kind="too_large", status=413)
    return path.read_bytes()


def _urllib_fetch(url: str, max_bytes: int | None, timeout_s: float) -> bytes:
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        # A redirect could lead to a host that is not allowed.
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with opener.open(url, timeout=timeout_s) as r:
        if r.status != 200:
            raise OSError(f"{url} answered {r.status}")
        limit = None if max_bytes is None else max_bytes + 1
        data = r.read(limit) if limit is not None else r.read()
    if max_bytes is not None and len(data) > max_bytes:
        raise OverflowError(f"over {max_bytes} bytes")
    return data


def _remote(url: str, policy: SourcePolicy, bad: Callable[..., PartError]) -> bytes:
    split = urlsplit(url)
    host = split.hostname or ""
    hostport = f"{host}:{split.port}" if split.port else host
    if host not in policy.allow_hosts and hostport not in policy.allow_hosts:
        raise bad(
            f"remote URLs are read only from allowed hosts (allow_hosts); {hostport!r} is not one",
            kind="forbidden_url",
            status=403,
        )
    fetch = policy.fetch or _urllib_fetch
    try:
        return fetch(url, policy.max_bytes, policy.fetch_timeout_s)
    except OverflowError:
        raise bad(f"{url} is over {policy.max_bytes} bytes", kind="too_large", status=413) from None
    except PartError:
        raise
    except Exception as e:
        raise bad(f"fetching {url} failed ({e})", kind="fetch_failed", status=502) from None


def read_source(
    value: Any, modality: Modality, policy: SourcePolicy, bad: Callable[..., PartError], key: str
) -> Any:
    """A part's value as something preprocessing takes: bytes for every reference, objects as
    they are (when the policy takes objects)."""
    if isinstance(value, str):
        if key == "base64":
            return _b64(value, policy, bad)
        scheme = urlsplit(value).scheme.lower() if ":" in value[:12] else ""
        if scheme == "data":
            return _data_url(value, modality, policy, bad)
        if scheme in ("http", "https"):
            return _remote(value, policy, bad)
        if scheme == "file":
            return _local(unquote(urlsplit(value).path), policy, bad)
        if scheme and len(scheme) > 1:
            raise bad(f"unsupported URL {value[:40]!r}; use a path, file:, data: or http(s)")
        return _local(value, policy, bad)
    if modality == "video" and isinstance(value, (list, tuple)):
        if not value:
            raise bad("its list of frames is empty")
        return [read_source(v, "image", policy, bad, "image") for v in value]
    if not policy.allow_objects:
        raise bad(f"a {type(value).__name__} is not accepted here; send a URL")
    return value


def parse_messages(
    messages: Sequence[Mapping[str, Any]], policy: SourcePolicy = LIBRARY_POLICY
) -> ParsedChat:
    """Check every message and part, read every source (under `policy`), in prompt order."""
    if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or not messages:
        raise PartError("messages must be a non-empty list of {'role', 'content'} objects")
    out_messages: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for i, message in enumerate(messages):
        if hasattr(message, "model_dump"):  # pydantic messages (the OpenAI SDK's)
            message = message.model_dump()
        if not isinstance(message, Mapping) or "role" not in message:
            raise PartError(f"message {i} must be an object with a 'role'", message_index=i)
        content = message.get("content")
        if content is None or isinstance(content, str):
            out_messages.append(dict(message))
            continue
        if not isinstance(content, Sequence):
            raise PartError(
                f"message {i}: 'content' must be a string or a list of parts", message_index=i
            )
        parts = []
        for j, part in enumerate(content):
            text, item = parse_part(part, i, j, policy)
            parts.append(text)
            if item is not None:
                media.append(item)
        out_messages.append({**message, "content": parts})
    return ParsedChat(out_messages, media)


def parse_part(
    part: Any, message_index: int, part_index: int, policy: SourcePolicy = LIBRARY_POLICY
) -> tuple[dict[str, Any], MediaPart | None]:
    """One part -> (its Qwen-form dict for the template, its media or None for text)."""
    where = f"message {message_index} part {part_index}"

    def bad(text: str, kind: str = "bad_part", status: int = 422) -> PartError:
        return PartError(
            f"{where}: {text}",
            kind=kind,
            status=status,
            message_index=message_index,
            part_index=part_index,
        )

    if isinstance(part, str):
        part = {"type": "text", "text": part}
    if not isinstance(part, Mapping):
        raise bad(f"a part must be an object with a 'type', got {type(part).__name__}")
    kind = _type_of(part)
    if kind not in PART_TYPES:
        raise bad(f"unknown part type {kind!r}; expected one of {', '.join(PART_TYPES)}")
    modality, keys = PART_TYPES[kind]
    found = _value(part, keys)
    if modality == "text":
        if found is None or not isinstance(found[1], str):
            raise bad(f"a {kind} part needs a 'text' string")
        return {"type": "text", "text": found[1]}, None
    if found is None:
        raise bad(f"a {kind} part has no {modality}: expected one of {', '.join(keys)}")
    options = _check_options(part, modality, bad)  # type: ignore[arg-type]
    source = read_source(found[1], modality, policy, bad, found[0])  # type: ignore[arg-type]
    # The template sees the part in Qwen form with its keys (media as placeholders), as the
    # Qwen templates test `type` or the media key.
    shown = {k: v for k, v in part.items() if k not in keys}
    shown.update({"type": modality, modality: found[1]})
    return shown, MediaPart(modality, source, options, message_index, part_index)  # type: ignore[arg-type]
