"""A chat request's media parts: found with mmferry's content-part parser, keyed for routing,
and rewritten for the engine once the encoders have answered.

Only image and video parts are parsed (text, and parts of types mmferry does not read, such as
audio, pass as they are). The parser runs with reads deferred: the proxy checks each source
(its scheme, an allowed host, a data: URL's size) but reads nothing; the encoders read.

vLLM refuses a request that mixes raw and embedding parts of one modality, so when any item of
a modality must go as pixels, every item of that modality goes as pixels; in connector mode the
ones an encoder holds keep their hash as uuid, and vLLM's connector still loads their rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmferry.chat.parts import PART_TYPES, MediaPart, PartError, SourcePolicy, parse_part
from mmferry.server.limits import RequestError, over_limit
from mmferry.server.sources import refused

MEDIA_KEYS = ("image", "image_url", "video")  # a part without "type" is typed by these


@dataclass(frozen=True)
class Media:
    """One image or video of a request: where it is, the client's part, its routing key."""

    part: MediaPart
    raw: dict[str, Any]
    key: str

    @property
    def modality(self) -> str:
        return self.part.modality


@dataclass(frozen=True)
class Encoded:
    """What an encoder answered for one item: its facts (hash, grid, timestamps) and, in
    embeds mode, its `[main | ds...]` rows."""

    facts: dict[str, Any]
    rows: Any = None  # torch.Tensor in embeds mode


def route_key(part: MediaPart) -> str:
    """The item's routing key: its source as sent (URL, path or data payload) and its options.

    The same bytes sent the same way get the same key, so repeats reach the encoder that
    caches them; the item's own hash is known only once an encoder has read it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(part.modality.encode())
    sources = part.source if isinstance(part.source, list) else [part.source]
    for ref in sources:
        h.update(f"\0{ref.scheme}\0{len(ref.value)}\0".encode())
        h.update(ref.value.encode())
    h.update(json.dumps(dict(part.options), sort_keys=True).encode())
    return h.hexdigest()


def _is_media(raw: Any) -> bool:
    if not isinstance(raw, dict):
        return False
    kind = raw.get("type")
    if kind is None:
        return any(k in raw for k in MEDIA_KEYS)
    return isinstance(kind, str) and PART_TYPES.get(kind, ("text",))[0] != "text"


def find_media(body: Any, policy: SourcePolicy) -> list[Media]:
    """The image and video parts of a chat completion body, in prompt order; a part the parser
    refuses is the client's error (its status, kind and message)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return []  # not ours to judge: the engine answers
    found: list[Media] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, raw in enumerate(content):
            if not _is_media(raw):
                continue
            try:
                part = parse_part(raw, i, j, policy)[1]
            except PartError as e:
                raise refused(e) from None
            assert part is not None
            found.append(Media(part, raw, route_key(part)))
            if policy.max_items is not None and len(found) > policy.max_items:
                raise over_limit(
                    "the number of images and videos", len(found), "max_items", policy.max_items
                )
    return found


def _ref_part(facts: dict[str, Any], uuid: str) -> dict[str, Any]:
    """A grid-and-uuid part: vLLM's encoder-cache connector loads the rows by uuid."""
    m = facts["modality"]
    payload: dict[str, Any] = {f"{m}_grid_thw": list(facts["grid_thw"])}
    if m == "video" and facts.get("timestamps") is not None:
        payload["timestamps"] = list(facts["timestamps"])
    return {"type": f"{m}_embeds", f"{m}_embeds": payload, "uuid": uuid}


def _embeds_part(facts: dict[str, Any], rows: Any) -> dict[str, Any]:
    from mmferry.engines.rows import EngineItem
    from mmferry.engines.vllm import content_part

    stamps = facts.get("timestamps")
    item = EngineItem(
        facts["modality"],
        tuple(facts["grid_thw"]),
        rows,
        facts["hash"],
        None if stamps is None else tuple(stamps),
    )
    return content_part(item)


def pixel_part(media: Media, uuid: str | None = None) -> dict[str, Any]:
    """The item as the engine reads pixels: the client's part (an OpenAI `image_url` or
    `video_url` as it came; a Qwen-form part as the OpenAI one), with `uuid` when given."""
    raw, m = media.raw, media.modality
    if raw.get("type") in ("image_url", "video_url", "input_image"):
        part = dict(raw)
    else:
        value = next((raw[k] for k in (m, "url", "path", "base64", f"{m}_url") if raw.get(k)), None)
        if isinstance(value, dict):
            value = value.get("url")
        if "base64" in raw and value is raw.get("base64"):
            value = f"data:{m}/*;base64,{value}"
        elif isinstance(value, str) and value.startswith("/"):
            value = "file://" + value
        part = {"type": f"{m}_url", f"{m}_url": {"url": value}}
    if uuid is not None:
        part["uuid"] = uuid
    else:
        part.pop("uuid", None)
    return part


def by_reference(media: Sequence[Media], answers: Sequence[Encoded | None], mode: str) -> int:
    """How many items `rewrite` sends as a grid and a uuid alone (connector mode): the engine
    has no pixels for them, only the connector's load."""
    if mode != "connector":
        return 0
    pixels = _pixel_modalities(media, answers)
    return sum(m.modality not in pixels for m in media)


def _pixel_modalities(media: Sequence[Media], answers: Sequence[Encoded | None]) -> set[str]:
    """The modalities that go as pixels: vLLM refuses raw and embedding parts of one modality
    in one request, so one item without an encoder's answer sends its whole modality."""
    return {m.modality for m, a in zip(media, answers) if a is None}


def uuid(answer: Encoded, media: Media) -> str:
    """The item's name for the engine's connector: its hash, and the key the proxy routed it
    by, so the connector asks the encoders in the proxy's order."""
    return f"{answer.facts['hash']}@{media.key}"


def rewrite(
    body: dict[str, Any],
    media: Sequence[Media],
    answers: Sequence[Encoded | None],
    mode: str,
    *,
    pixels_only: bool = False,
) -> dict[str, Any]:
    """`body` with each media part replaced for the engine (`answers[i]` None: pixels). With
    `pixels_only`, every item as its pixels and no uuid: the engine encodes them all (vLLM
    keys its processor cache by uuid, so a uuid it saw as a grid alone would bring the grid
    back)."""
    pixels = {m.modality for m in media} if pixels_only else _pixel_modalities(media, answers)
    messages = [dict(m) if isinstance(m, dict) else m for m in body["messages"]]
    for msg in messages:
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            msg["content"] = list(msg["content"])
    for m, answer in zip(media, answers):
        if m.modality in pixels:
            # NOTE: in connector mode a held item keeps its uuid: the connector loads its rows
            # and the engine only preprocesses (and pins are released by that load).
            held = answer is not None and mode == "connector" and not pixels_only
            new = pixel_part(m, uuid(answer, m) if held else None)
        elif mode == "connector":
            new = _ref_part(answer.facts, uuid(answer, m))
        else:
            new = _embeds_part(answer.facts, answer.rows)
        messages[m.part.message_index]["content"][m.part.part_index] = new
    return {**body, "messages": messages}


def client_error(status: int, text: str, media: Media) -> RequestError:
    """An encoder's refusal of one item as the client's answer: its status and kind, the
    message naming the item where the client put it (the encoder saw it as part 0)."""
    try:
        err = json.loads(text)["error"]
        kind, message = str(err["kind"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "encoder_refused", text[:500]
    if message.startswith("part 0"):
        message = media.part.where + message[len("part 0") :]
    return RequestError(status, kind, message)
