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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmferry.chat.sources import (
    LIBRARY_POLICY,
    Bad,
    Modality,
    PartError,
    Reference,
    SourcePolicy,
    read,
    read_source,
    shown,
)

__all__ = [
    "IMAGE_KEYS",
    "LIBRARY_POLICY",
    "MEDIA_KEYS",
    "MEDIA_TYPES",
    "PART_TYPES",
    "VIDEO_KEYS",
    "MediaPart",
    "ParsedChat",
    "PartError",
    "SourcePolicy",
    "parse_content",
    "parse_messages",
    "check_values",
    "media_kind",
    "media_name",
    "parse_part",
    "read_part",
]

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
    "image_pil": ("image", ("image_pil",)),
    "video": ("video", ("video", "url", "path", "video_url")),
    "video_url": ("video", ("video_url", "url")),
}
# What each reader takes as media, by part type and by key: mmferry's and qwen-vl-utils' forms,
# and vLLM's chat parser (its `MM_PARSER_MAP`), which reads a part with no type, or one with a
# `uuid` whatever its type, by the first of its media keys present (even one set to null: a
# uuid alone names an item vLLM has cached). The kind is a modality mmferry encodes, or one
# it does not read ("embeds": rows or tensors a client computed; "audio").
MEDIA_TYPES: dict[str, str] = {
    "image": "image",
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "video": "video",
    "video_url": "video",
    "image_embeds": "embeds",
    "video_embeds": "embeds",
    "audio_embeds": "embeds",
    "prompt_embeds": "embeds",
    "audio_url": "audio",
    "input_audio": "audio",
}
MEDIA_KEYS: dict[str, str] = {k: v for k, v in MEDIA_TYPES.items() if k != "input_image"}


@dataclass(frozen=True)
class MediaPart:
    """One image or video of a conversation, its source read, with its per-item keys."""

    modality: Modality
    # Encoded bytes, a PIL image, an array / tensor, or (videos) a list of such frames; with a
    # policy that defers reads, a `Reference` (or a list of them) until `read_part`.
    source: Any
    options: Mapping[str, Any]
    message_index: int | None  # None: a bare list of content parts (a service's `content`)
    part_index: int

    @property
    def where(self) -> str:
        if self.message_index is None:
            return f"part {self.part_index}"
        return f"message {self.message_index} part {self.part_index}"

    def error(self, text: str, *, kind: str = "bad_request", status: int = 422) -> PartError:
        return PartError(
            f"{self.where} ({self.modality}): {text}",
            kind=kind,
            status=status,
            message_index=self.message_index,
            part_index=self.part_index,
        )

    def references(self) -> list[Reference]:
        """The sources still to read (a policy with `defer_reads`), in order."""
        sources = self.source if isinstance(self.source, list) else [self.source]
        return [s for s in sources if isinstance(s, Reference)]


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
        if value is not None and not (isinstance(value, str) and not value):
            return key, value
    return None


def _type_of(part: Mapping[str, Any]) -> Any:
    kind = part.get("type")
    if kind is not None:
        return kind
    # qwen-vl-utils reads parts by their media key; the Qwen templates and vLLM do too.
    return next((k for k in MEDIA_KEYS if k in part), "text" if "text" in part else None)


def media_kind(part: Any, bad: Bad) -> str | None:
    """What `part` is as media for any reader of it (`MEDIA_TYPES`' kinds), None when no reader
    takes it as media; `bad(...)` for a part two readers could read as different things: one
    that names two media (keys or type and key), or a text part that names one (vLLM reads a
    text part that has a `uuid` by its media key)."""
    if not isinstance(part, Mapping):
        return None
    keys = [k for k in MEDIA_KEYS if k in part]
    kind = part.get("type")
    typed = MEDIA_TYPES.get(kind) if isinstance(kind, str) else None
    if typed is not None:
        # A typed part's own value keys (`url`, `path`...) count against its media keys.
        own = [k for k in PART_TYPES.get(kind, ("", ()))[1] if k in part and k not in keys]
        named = keys + own
        if len(named) > 1 or (keys and MEDIA_KEYS[keys[0]] != typed):
            raise bad(f"a {kind} part names its media once; this one has {', '.join(named)}")
        return typed
    if len(keys) > 1:
        raise bad(f"a part names one medium; this one has {', '.join(keys)}")
    if keys and kind is not None:
        raise bad(
            f"a part of type {shown(kind)} cannot carry {keys[0]!r} (it would be read as media "
            "by its key); send the media as a part of its own"
        )
    return MEDIA_KEYS[keys[0]] if keys else None


def media_name(part: Mapping[str, Any]) -> str:
    """How a media part names its kind: its type, or its media key."""
    kind = part.get("type")
    if isinstance(kind, str) and kind in MEDIA_TYPES:
        return kind
    return next((k for k in MEDIA_KEYS if k in part), "media")


def check_values(part: Any, bad: Bad) -> None:
    """Every string of `part` a Unicode text (a lone surrogate, valid JSON as `"\\ud800"`,
    cannot be encoded, hashed or sent on) and every number finite; 400 otherwise."""
    stack = [part]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise bad(
                        f"a string holds a lone surrogate ({value[e.start]!r} at position "
                        f"{e.start}), which is no Unicode character",
                        kind="bad_text",
                        status=400,
                    ) from None
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise bad(f"a number is {value!r}; numbers must be finite", status=400)
        elif isinstance(value, Mapping):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _check_options(part: Mapping[str, Any], modality: Modality, bad: Bad) -> dict[str, Any]:
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


def _count(media: list[MediaPart], policy: SourcePolicy) -> None:
    if policy.max_items is not None and len(media) > policy.max_items:
        raise PartError(
            f"more images and videos than {policy.named('max_items')}={policy.max_items} allows",
            kind="over_limit",
        )


def parse_messages(
    messages: Sequence[Mapping[str, Any]], policy: SourcePolicy = LIBRARY_POLICY
) -> ParsedChat:
    """Check every message and part, read every source (under `policy`), in prompt order."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
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
        if isinstance(content, Mapping) or not isinstance(content, Sequence):
            raise PartError(
                f"message {i}: 'content' must be a string or a list of parts", message_index=i
            )
        parts = []
        for j, part in enumerate(content):
            text, item = parse_part(part, i, j, policy)
            parts.append(text)
            if item is not None:
                media.append(item)
                _count(media, policy)
        out_messages.append({**message, "content": parts})
    return ParsedChat(out_messages, media)


def parse_content(content: Sequence[Any], policy: SourcePolicy = LIBRARY_POLICY) -> list[MediaPart]:
    """The media of a bare list of content parts (text parts checked and skipped), in order."""
    if isinstance(content, (str, Mapping)) or not isinstance(content, Sequence):
        raise PartError("'content' must be a list of parts")
    media: list[MediaPart] = []
    for j, part in enumerate(content):
        item = parse_part(part, None, j, policy)[1]
        if item is not None:
            media.append(item)
            _count(media, policy)
    return media


def parse_part(
    part: Any, message_index: int | None, part_index: int, policy: SourcePolicy = LIBRARY_POLICY
) -> tuple[dict[str, Any], MediaPart | None]:
    """One part -> (its Qwen-form dict for the template, its media or None for text)."""
    where = f"part {part_index}"
    if message_index is not None:
        where = f"message {message_index} {where}"

    def bad(text: str, kind: str = "bad_request", status: int = 422) -> PartError:
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
        raise bad(f"a part must be an object with a 'type', got {shown(part)}")
    # NOTE: audio and embeddings are no types of PART_TYPES: refused below as unknown.
    if media_kind(part, bad) is not None:
        check_values(part, bad)
    kind = _type_of(part)
    if kind is None:
        raise bad(f"a part needs a 'type' ({', '.join(PART_TYPES)}) or an image or video key")
    if not isinstance(kind, str):
        raise bad(f"a part's 'type' must be a string, got {shown(kind)}")
    if kind not in PART_TYPES:
        raise bad(
            f"unknown part type {shown(kind)} (a part of an unknown type is refused, not "
            f"skipped); expected one of {', '.join(PART_TYPES)}"
        )
    modality, keys = PART_TYPES[kind]
    found = _value(part, keys)
    if modality == "text":
        if found is None or not isinstance(found[1], str):
            raise bad(f"a {kind} part needs a 'text' string")
        return {"type": "text", "text": found[1]}, None
    if found is None:
        raise bad(f"a {kind} part has no {modality}: expected one of {', '.join(keys)}")
    if found[0] == "image_pil" and isinstance(found[1], str):
        raise bad("image_pil holds a PIL image, not a string; send a URL as an image_url part")
    options = _check_options(part, modality, bad)  # type: ignore[arg-type]
    source = read_source(found[1], modality, policy, bad, found[0])  # type: ignore[arg-type]
    # The template sees the part in Qwen form with its keys (media as placeholders), as the
    # Qwen templates test `type` or the media key.
    shown_part = {k: v for k, v in part.items() if k not in keys}
    shown_part.update({"type": modality, modality: found[1]})
    return shown_part, MediaPart(modality, source, options, message_index, part_index)  # type: ignore[arg-type]


def read_part(
    part: MediaPart, policy: SourcePolicy, fetched: Mapping[str, bytes] | None = None
) -> MediaPart:
    """`part` with its `Reference`s read: remote ones from `fetched` (URL -> bytes) where the
    caller fetched them itself, else with `policy.fetch`."""
    fetched = fetched or {}

    def bad(text: str, kind: str = "bad_request", status: int = 422) -> PartError:
        return PartError(
            f"{part.where}: {text}",
            kind=kind,
            status=status,
            message_index=part.message_index,
            part_index=part.part_index,
        )

    def one(source: Any) -> Any:
        if not isinstance(source, Reference):
            return source
        if source.scheme == "remote" and source.value in fetched:
            return fetched[source.value]
        return read(source, policy, bad)

    source = part.source
    source = [one(s) for s in source] if isinstance(source, list) else one(source)
    return dataclasses.replace(part, source=source)
