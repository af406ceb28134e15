"""What vLLM 0.32's chat parser reads a content part as (`vllm/renderers/chat_utils.py`,
`_parse_chat_message_content_mm_part`), written out here for the tests, and a corpus of parts
in every type and key combination. test_vllm_parts.py holds this reading to vLLM's own parser
over the corpus; the property test (test_boundary_property.py) uses it on what reaches the
engine."""

from __future__ import annotations

import itertools
import random
from typing import Any

# The part types vLLM parses by type (when the part has no uuid), text-like and media.
TEXT_TYPES = frozenset({"text", "thinking", "input_text", "output_text", "refusal"})
MEDIA_TYPES = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)
# The keys a part with no type, or with a uuid, is read by, in vLLM's order.
KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)


def reads(part: Any) -> str | None:
    """The media type vLLM reads `part` as (its `part_type`), None when it reads no media
    (text, or a part it refuses)."""
    if not isinstance(part, dict):
        return None
    kind, uuid = part.get("type"), part.get("uuid")
    typed = isinstance(kind, str) and kind in TEXT_TYPES | MEDIA_TYPES | {"tool_reference"}
    if typed and uuid is None:
        return kind if kind in MEDIA_TYPES else None
    if kind is None or uuid is not None:
        key = next((k for k in KEYS if k in part), None)
        return key if key in MEDIA_TYPES else None
    return None


PNG = "data:image/png;base64,iVBORw0KGgo="
VALUES: list[Any] = [
    PNG,
    "http://169.254.169.254/latest",
    "/etc/hostname",
    {"url": PNG},
    {"url": "http://169.254.169.254/latest"},
    None,
    "",
    5,
    [PNG, PNG],
    {"data": "AAAA", "format": "wav"},
]
TYPES: list[Any] = [
    None,
    *sorted(TEXT_TYPES | MEDIA_TYPES),
    "tool_reference",
    "image",
    "video",
    "picture",
    5,
]
CORPUS_KEYS = (*KEYS, "image", "video", "url", "path", "base64", "text", "data")


def corpus(seed: int = 0) -> list[dict[str, Any]]:
    """Parts of every type with every set of up to two media keys, with and without a uuid
    (null or a string), each key given a value drawn from VALUES."""
    rng = random.Random(seed)
    parts = []
    subsets = [()] + [(k,) for k in CORPUS_KEYS] + list(itertools.combinations(CORPUS_KEYS, 2))
    for kind, keys, uuid in itertools.product(TYPES, subsets, ("absent", None, "client-uuid")):
        part: dict[str, Any] = {} if kind is None else {"type": kind}
        if kind == "input_image":
            part["detail"] = "auto"  # the Responses API's schema requires it
        for key in keys:
            part[key] = rng.choice(VALUES)
        if uuid != "absent":
            part["uuid"] = uuid
        parts.append(part)
    return parts
