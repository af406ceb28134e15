"""A chat request's media parts: found with mmferry's content-part parser, keyed for routing,
and rewritten for the engine once the encoders have answered.

Every part any reader takes as media is the parser's (`chat/parts.py`'s `media_kind`: typed
or untyped, by its keys when it has a `uuid`, as vLLM's chat parser reads it): images and
videos are parsed, checked and rewritten; audio, and embeddings a client computed (unless the
operator allows them, `--allow-client-embeds`), are refused; text passes as it is. The parser
runs with reads deferred: the proxy checks each source (its scheme, an allowed host, a data:
URL's size) but reads nothing; the encoders read. Every media part the engine gets is built
here, from the checked source alone: no key of the client's part rides along.

vLLM refuses a request that mixes raw and embedding parts of one modality, so when any item of
a modality must go as pixels, every item of that modality goes as pixels; in connector mode the
ones an encoder holds keep their hash as uuid, and vLLM's connector still loads their rows. An
item goes as pixels only when vLLM would read it as the encoder did: its data: payload or its
allowed http(s) URL, with no per-item key (vLLM applies none of qwen-vl-utils' sizes or frame
counts, so it would plan other rows than the uuid names). A list of frames, a local path (the
engine is never handed one) or an item with such keys cannot: the request is refused (503,
naming the item) rather than answered from other pixels than the client sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from mmferry.chat.parts import (
    MediaPart,
    PartError,
    SourcePolicy,
    media_kind,
    media_name,
    parse_part,
)
from mmferry.chat.sources import Reference
from mmferry.routing import item_name
from mmferry.server.limits import RequestError, over_limit
from mmferry.server.sources import refused

# How an encoder's refusal names the part of its call it is about.
_PART = re.compile(r"part (\d+)\b")


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
    # Named by the proxy ahead of its encode: the rank, among the item's choices, of the
    # encoder it was sent to (routing.py's `item_name`).
    ahead: int | None = None
    url: str | None = None  # the encoder that holds it


def route_key(part: MediaPart) -> str:
    """The item's routing key: its source as sent (URL, path or data payload) and its options.

    The same bytes sent the same way get the same key, so repeats reach the encoder that
    caches them; the item's own hash is known only once an encoder has read it."""
    # NOTE: blake3, not blake2b: a data: URL is hashed whole on the proxy's one loop, and blake3
    # takes a quarter of blake2b's time on 40 KB (10 against 44 us).
    h = blake3(part.modality.encode())
    sources = part.source if isinstance(part.source, list) else [part.source]
    for ref in sources:
        h.update(f"\0{ref.scheme}\0{len(ref.value)}\0".encode())
        h.update(ref.value.encode())
    h.update(json.dumps(dict(part.options), sort_keys=True).encode())
    return h.hexdigest(length=16)


def part_kind(raw: Any, i: int, j: int, allow_embeds: bool = False) -> str | None:
    """Message `i` part `j` as media: "image" or "video" (the parser's to check), None for a
    part to pass as it is (text, or embeddings the operator allows); RequestError for a part
    the proxy refuses."""

    def bad(text: str, kind: str = "bad_request", status: int = 422) -> PartError:
        return PartError(f"message {i} part {j}: {text}", kind=kind, status=status)

    try:
        what = media_kind(raw, bad)
    except PartError as e:
        raise refused(e) from None
    if what == "embeds" and not allow_embeds:
        raise refused(
            bad(
                f"{media_name(raw)} parts (embeddings a client computed, named by a uuid it "
                "chose) are not accepted; send the image or video itself "
                "(an operator may allow them with --allow-client-embeds)"
            )
        )
    if what == "audio":
        raise refused(bad(f"{media_name(raw)} parts are not accepted: the encoders read images"))
    return None if what == "embeds" else what


# Request fields that change how vLLM loads and processes media (behind its
# --trust-request-mm-kwargs): the encoders apply neither, so the rows would not be the ones
# asked for, and an item sent as pixels under its uuid would not fit the rows the uuid names.
ENGINE_MEDIA_OPTIONS = ("mm_processor_kwargs", "media_io_kwargs")


def find_media(body: Any, policy: SourcePolicy, allow_embeds: bool = False) -> list[Media]:
    """The image and video parts of a chat completion body, in prompt order; a part the parser
    refuses is the client's error (its status, kind and message)."""
    found = _find(body, policy, allow_embeds)
    given = [k for k in ENGINE_MEDIA_OPTIONS if found and body.get(k)]
    if given:
        raise RequestError(
            422,
            "bad_request",
            f"{' and '.join(given)} cannot go with images or videos through this proxy: its "
            "encoders apply neither; set sizes and frame rates per item (resized_height, "
            "max_pixels, fps, ...)",
        )
    return found


def _find(body: Any, policy: SourcePolicy, allow_embeds: bool) -> list[Media]:
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return []  # not ours to judge: the engine answers
    found: list[Media] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, raw in enumerate(content):
            if part_kind(raw, i, j, allow_embeds) is None:
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


def pixel_source(media: Media) -> str:
    """The URL under which vLLM reads the item as the encoder did; `NotAsPixels` when there is
    none."""
    m, part = media.modality, media.part
    if part.options:
        keys = ", ".join(sorted(part.options))
        raise NotAsPixels(media, f"vLLM does not apply its per-item keys ({keys})")
    if not isinstance(part.source, Reference):
        raise NotAsPixels(media, "a list of frames has no URL vLLM reads")
    ref = part.source
    if ref.scheme == "path":
        raise NotAsPixels(media, "the engine is not handed local paths")
    if ref.scheme == "remote":
        return ref.value  # an allowed host's URL, as checked
    # NOTE: vLLM reads a video/jpeg data: URL as JPEG frames joined by commas, mmferry as one
    # file; any other media type is one file to both.
    kind = ref.media_type if ref.media_type.startswith(f"{m}/") else f"{m}/*"
    if kind == "video/jpeg":
        kind = "video/*"
    return f"data:{kind};base64,{ref.value}"


class NotAsPixels(Exception):
    """An item vLLM cannot be given as pixels that it would read as the encoder did."""

    def __init__(self, media: Media, why: str) -> None:
        super().__init__(f"{media.part.where} cannot go to the engine as pixels: {why}")
        self.media = media


def pixel_part(media: Media, uuid: str | None = None) -> dict[str, Any]:
    """The item as the engine reads pixels (an OpenAI `image_url` or `video_url` part built from
    its checked source alone), with `uuid` when given; `NotAsPixels` when it cannot be."""
    m = media.modality
    part: dict[str, Any] = {"type": f"{m}_url", f"{m}_url": {"url": pixel_source(media)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def by_reference(media: Sequence[Media], answers: Sequence[Encoded | None], mode: str) -> list[int]:
    """The items `rewrite` sends as a grid and a uuid alone (connector mode): the engine has no
    pixels for them, only the connector's load."""
    if mode != "connector":
        return []
    pixels = _pixel_modalities(media, answers)
    return [i for i, m in enumerate(media) if m.modality not in pixels]


def _pixel_modalities(media: Sequence[Media], answers: Sequence[Encoded | None]) -> set[str]:
    """The modalities that go as pixels: vLLM refuses raw and embedding parts of one modality
    in one request, so one item without an encoder's answer, or one the engine takes as pixels
    only (the generic family's: held, its rows loaded by uuid), sends its whole modality."""
    return {m.modality for m, a in zip(media, answers) if a is None or a.facts.get("pixels")}


def uuid(answer: Encoded, media: Media) -> str:
    """The item's name for the engine's connector: its hash, and the key the proxy routed it
    by, so the connector asks the encoders in the proxy's order (routing.py's `item_name`)."""
    return item_name(answer.facts["hash"], media.key, answer.ahead)


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
            try:
                new = pixel_part(m, uuid(answer, m) if held else None)
            except NotAsPixels as e:
                if answer is not None and answer.facts.get("pixels"):
                    raise RequestError(
                        422,
                        "bad_request",
                        f"{e}; the engine reads this model's images from their pixels only "
                        "(its rows are loaded by uuid): send a data: URL or an allowed URL",
                    ) from None
                raise _no_pixels(e, media, answers) from None
        elif mode == "connector":
            new = _ref_part(answer.facts, uuid(answer, m))
        else:
            new = _embeds_part(answer.facts, answer.rows)
        messages[m.part.message_index]["content"][m.part.part_index] = new
    return {**body, "messages": messages}


def _no_pixels(
    e: NotAsPixels, media: Sequence[Media], answers: Sequence[Encoded | None]
) -> RequestError:
    """503 naming the item no encoder took and the one that cannot follow it as pixels."""
    unserved = next(
        (m for m, a in zip(media, answers) if a is None and m.modality == e.media.modality),
        e.media,
    )
    why = str(e)
    if unserved is not e.media:
        why = (
            f"{unserved.part.where} could not be encoded, so every {e.media.modality} of the "
            f"request goes to the engine as pixels, and {why}"
        )
    return RequestError(503, "no_encoder", f"no encoder could take an item: {why}; retry later")


def as_pixels(media: Sequence[Media]) -> bool:
    """Whether every item can go to the engine as pixels (`pixel_source`)."""
    try:
        for m in media:
            pixel_source(m)
    except NotAsPixels:
        return False
    return True


def _refusal(text: str) -> tuple[str, str]:
    """An encoder's error body as (kind, message)."""
    try:
        err = json.loads(text)["error"]
        return str(err["kind"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "encoder_refused", text[:500]


def client_error(status: int, text: str, media: Sequence[Media]) -> RequestError:
    """An encoder's refusal of an item as the client's answer: its status and kind, the
    message naming the item where the client put it (the encoder saw `media[k]` as part k)."""
    kind, message = _refusal(text)
    found = _PART.match(message)
    if found is not None and int(found.group(1)) < len(media):
        message = media[int(found.group(1))].part.where + message[found.end() :]
    return RequestError(status, kind, message)


# The service's kinds for a remote source whose origin failed (`server/remote.py`): its status
# not 200, a redirect (never followed), no answer, or past --fetch-timeout.
ORIGIN_FAILED = {502: "fetch_failed", 504: "fetch_timeout"}


def origin_failed(status: int, text: str) -> bool:
    """Whether an encoder's error answer says a client's URL failed at its origin (about one of
    the call's parts), not that the encoder failed."""
    kind, message = _refusal(text)
    return ORIGIN_FAILED.get(status) == kind and _PART.match(message) is not None


def names_a_part(text: str) -> bool:
    """Whether an encoder's refusal is about one of the call's parts (else the call itself:
    its size or its count of items)."""
    return _PART.match(_refusal(text)[1]) is not None
