"""A request's parts or chat messages -> media checked under the operator's limits.

The body holds bare content parts (`content`) or whole chat messages (`messages`); both are
parsed by `mmferry.chat.parts`, the parser the library uses, under a `SourcePolicy` built from
the limits: allowed folders and hosts, the byte and item limits, absolute paths only, no
in-memory objects, and reads deferred, so that files are read on the preprocessing threads and
URLs fetched on the event loop (remote.py). `check_media` then bounds pixels and frames from
each file's header, before any pixel is decoded; a list of frames is counted before any frame
is read (`check_frame_count`) and each frame checked as it is read (`check_frame`), so one
frame is held at a time.
"""

from __future__ import annotations

import io
import re
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmferry.chat import qwen_keys
from mmferry.chat.parts import MediaPart, PartError, SourcePolicy, parse_content, parse_messages
from mmferry.config import ProcessorConfig
from mmferry.server.limits import Limits, RequestError, option, over_limit

BODY_FIELDS = ("content", "messages")


def source_policy(limits: Limits) -> SourcePolicy:
    """What a request may make the service read."""
    return SourcePolicy(
        allow_paths=limits.allow_paths,
        relative_paths=False,  # the server's working folder is no client's business
        allow_hosts=limits.allow_hosts,
        max_bytes=limits.max_request_bytes,
        max_items=limits.max_items,
        fetch_timeout_s=limits.fetch_timeout_s,
        allow_objects=False,
        defer_reads=True,
        option_names={
            "max_bytes": option("max_request_bytes"),
            "max_items": option("max_items"),
            "allow_paths": option("allow_paths"),
            "allow_hosts": option("allow_hosts"),
        },
    )


def refused(e: PartError) -> RequestError:
    """The service's answer to a part the parser refused: its status, kind and message."""
    return RequestError(e.status, e.kind, str(e))


def _bad(message: str) -> RequestError:
    return RequestError(422, "bad_request", message)


def parse_request(body: Any, policy: SourcePolicy) -> tuple[list[MediaPart], dict[str, Any]]:
    """The media of `content` or `messages`, in order (sources checked, not read), and the
    other fields (the options); 422 for anything malformed."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object with 'content' (parts) or 'messages'")
    given = [f for f in BODY_FIELDS if f in body]
    if not given:
        raise _bad(
            "missing field 'content' (a list of image_url / video_url parts) or 'messages' "
            "(chat messages)"
        )
    if len(given) > 1:
        raise _bad("send either 'content' or 'messages', not both")
    try:
        if given[0] == "messages":
            media = parse_messages(body["messages"], policy).media
        else:
            media = parse_content(body["content"], policy)
    except PartError as e:
        raise refused(e) from None
    if not media:
        raise _bad(f"'{given[0]}' has no image or video part")
    return media, {k: v for k, v in body.items() if k not in BODY_FIELDS}


def _pillow_limit(name: str, e: Exception, limits: Limits) -> RequestError:
    """422 for an image past Pillow's own decompression-bomb limit, naming --limit-pixels."""
    found = re.search(r"\((\d+) pixels\)", str(e))
    pixels = f"{found.group(1)} pixels" if found else "more pixels than Pillow opens"
    flag = option("max_pixels")
    limit = f"{flag[2:].replace('-', '_')}={limits.max_pixels}"
    hard = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    message = f"{name}: {pixels}, more than {limit} ({flag})"
    if limits.max_pixels >= hard:
        message = (
            f"{name}: {pixels}, more than Pillow opens ({hard} pixels), which caps {limit} ({flag})"
        )
    return RequestError(422, "over_limit", message)


def _check_image(data: bytes, name: str, limits: Limits) -> None:
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        raise _pillow_limit(name, e, limits) from None
    except UnidentifiedImageError:
        # NOTE: Pillow's message names its BytesIO object, which tells the client nothing.
        raise RequestError(
            422,
            "bad_media",
            f"{name}: cannot decode image: not a readable image (no image format Pillow reads "
            f"starts with {data[:8]!r})",
        ) from None
    except Exception as e:  # noqa: BLE001 - Pillow's header parsers raise many types
        raise RequestError(
            422, "bad_media", f"{name}: cannot decode image: not a readable image ({e})"
        ) from None
    if w * h > limits.max_pixels:
        raise over_limit(f"{name}: {w}x{h} pixels", w * h, "max_pixels", limits.max_pixels)


def _check_frames(name: str, held: int, total: int, limits: Limits) -> None:
    if held > limits.max_frames:
        raise over_limit(
            f"{name}: the number of sampled frames (of {total} in the file)",
            held,
            "max_frames",
            limits.max_frames,
        )


def check_frame_count(part: MediaPart, limits: Limits, cfg: ProcessorConfig) -> None:
    """A list of frames against the frame limit, from its length alone (422): every listed
    frame is kept, padded to an even count, as qwen-vl-utils keeps them (no sampling)."""
    if part.modality != "video" or not isinstance(part.source, list):
        return
    n = len(part.source) + len(part.source) % qwen_keys.FRAME_FACTOR
    _check_frames(part.where, n + (-n % cfg.temporal_patch_size), len(part.source), limits)


def check_frame(part: MediaPart, k: int, data: bytes, limits: Limits) -> None:
    """Frame `k` of a list against the pixel limit, from its header (422)."""
    _check_image(data, f"{part.where} frame {k}", limits)


def check_media(part: MediaPart, limits: Limits, cfg: ProcessorConfig) -> None:
    """Pixel and frame limits from the headers, before any decoding (422); 422 if unreadable.
    Frames are counted as the part samples them: by its own keys (fps, nframes, ...) if any."""
    name, temporal = part.where, cfg.temporal_patch_size
    if part.modality == "image":
        _check_image(part.source, name, limits)
        return
    if isinstance(part.source, list):
        check_frame_count(part, limits, cfg)
        for k, frame in enumerate(part.source):
            check_frame(part, k, frame, limits)
        return
    from mmferry.preprocess.video import sample_indices
    from mmferry.preprocess.video_decode import probe_video

    try:
        info = probe_video(part.source, name)
        # NOTE: the bound is on what is decoded and held: the frames the processor samples
        # (padded to whole temporal patches), not the container's count.
        if part.options:
            sampled = len(qwen_keys.frame_indices(part.options, info.total_frames, info.fps)[0])
        else:
            sampled = len(sample_indices(cfg, info.total_frames, info.fps))
    except ValueError as e:
        text = str(e) if name in str(e) else f"{name}: {e}"
        raise RequestError(422, "bad_media", text) from None
    if info.height * info.width > limits.max_pixels:
        raise over_limit(
            f"{name}: frames of {info.width}x{info.height} pixels",
            info.height * info.width,
            "max_pixels",
            limits.max_pixels,
        )
    _check_frames(name, sampled + (-sampled % temporal), info.total_frames, limits)
