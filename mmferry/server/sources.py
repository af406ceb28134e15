"""A request's parts or chat messages -> media checked under the operator's limits.

The body holds bare content parts (`content`) or whole chat messages (`messages`); both are
parsed by `mmferry.chat.parts`, the parser the library uses, under a `SourcePolicy` built from
the limits: allowed folders and hosts, the byte and item limits, absolute paths only, no
in-memory objects, and reads deferred, so that files are read on the preprocessing threads and
URLs fetched on the event loop (remote.py). `check_media` then bounds pixels and frames from
each file's header, before any pixel is decoded: the source's size, and the size a part's
qwen-vl-utils keys resize it to, which the library takes as final (`mmferry.chat.media`), so
the service holds it to its own resize budgets. A list of frames is counted before any frame
is read (`check_frame_count`) and each frame checked as it is read (`check_frame`, the first
one sizing the list), so one frame is held at a time.
"""

from __future__ import annotations

import io
import re
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmferry.chat import qwen_keys
from mmferry.chat.parts import MediaPart, PartError, SourcePolicy, parse_content, parse_messages
from mmferry.config import ProcessorConfig
from mmferry.server.limits import Limits, RequestError, named, option, over_limit

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


def _check_image(data: bytes, name: str, limits: Limits) -> tuple[int, int]:
    """(height, width) of the image from its header; 422 past --limit-pixels."""
    # NOTE: the stored sides, not turned by an EXIF orientation (a PNG's may follow the pixel
    # data): a quarter turn swaps the sides, and every size rule gives the same pixels then.
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
    return h, w


def _check_frames(name: str, held: int, total: int, limits: Limits) -> None:
    if held > limits.max_frames:
        raise over_limit(
            f"{name}: the number of sampled frames (of {total} in the file)",
            held,
            "max_frames",
            limits.max_frames,
        )


def _keyed(name: str, size_fn: Any, *args: Any) -> tuple[int, int]:
    """A qwen-vl-utils size rule's answer, or 422 naming the part for keys it refuses."""
    try:
        return size_fn(*args)
    except ValueError as e:
        raise RequestError(422, "bad_media", f"{name}: {e}") from None


# NOTE: a resized size is held to the resize budgets, not to --limit-pixels, which bounds
# sources: the server's own resize may also give more than --limit-pixels (a small image
# raised to the minimum), and qwen-vl-utils raises every listed frame to 128 tokens at least.


def _check_keyed_image(name: str, h: int, w: int, cfg: ProcessorConfig) -> None:
    """422 for an image whose keys ask for more pixels than --max-pixels."""
    if h * w > cfg.image_max_pixels:
        raise over_limit(
            f"{name}: the size its qwen-vl-utils keys give, {w}x{h} pixels,",
            h * w,
            "image_max_pixels",
            cfg.image_max_pixels,
        )


def _check_keyed_video(name: str, n: int, h: int, w: int, cfg: ProcessorConfig) -> None:
    """422 for a video whose keys ask for more frames x size than the server's video budget
    gives that many frames (the family's rule: per frame, or across the frames)."""
    from mmferry.preprocess.video import video_target_size

    # NOTE: the server's own rule keeps a size its budget holds (sides are already multiples
    # of the factor) and shrinks one past it; asking the rule keeps the families' budgets in
    # their specs.
    th, tw = _keyed(name, video_target_size, cfg, n, h, w)
    if th * tw < h * w:
        raise RequestError(
            422,
            "over_limit",
            f"{name}: its qwen-vl-utils keys give {n} frames of {w}x{h} pixels ({n * h * w} in "
            f"all), more than {named('video_max_pixels', cfg.video_max_pixels)} allows: {n} "
            f"frames of at most {tw}x{th}",
        )


def check_frame_count(part: MediaPart, limits: Limits, cfg: ProcessorConfig) -> None:
    """A list of frames against the frame limit, from its length alone (422): every listed
    frame is kept, padded to an even count, as qwen-vl-utils keeps them (no sampling)."""
    if part.modality != "video" or not isinstance(part.source, list):
        return
    n = len(part.source) + len(part.source) % qwen_keys.FRAME_FACTOR
    _check_frames(part.where, n + (-n % cfg.temporal_patch_size), len(part.source), limits)


def check_frame(part: MediaPart, k: int, data: bytes, limits: Limits, cfg: ProcessorConfig) -> None:
    """Frame `k` of a list against the pixel limit, from its header (422); the first frame
    sizes the list, as qwen-vl-utils sizes it (keys or not), held to the budgets."""
    h, w = _check_image(data, f"{part.where} frame {k}", limits)
    if k == 0:
        name, keys, given = part.where, part.options, len(part.source)
        n = given + (-given % qwen_keys.FRAME_FACTOR)
        h, w = _keyed(name, qwen_keys.frame_list_size, h, w, keys, cfg.factor)
        h, w = _keyed(name, qwen_keys.video_size, n, h, w, keys, cfg.factor)
        _check_keyed_video(name, n, h, w, cfg)


def check_generic(part: MediaPart, processor: Any) -> None:
    """422 for what the generic family cannot carry: videos, and per-item size or frame keys
    (transformers' processor sizes every image by the checkpoint's own settings)."""
    if part.modality != "image":
        raise RequestError(422, "unsupported", f"{part.where}: {processor.no_video}")
    if part.options:
        keys = ", ".join(sorted(part.options))
        raise RequestError(
            422,
            "unsupported",
            f"{part.where}: per-item keys ({keys}) are not applied to a checkpoint served "
            f"through the generic family ({processor.facts.model_type}): its own processor "
            "sizes every image; send the image without them",
        )


def check_media(part: MediaPart, limits: Limits, cfg: ProcessorConfig | None) -> None:
    """Pixel and frame limits from the headers, before any decoding (422); 422 if unreadable.
    Frames are counted as the part samples them: by its own keys (fps, nframes, ...) if any.
    The size a part's qwen-vl-utils keys give is held to the server's resize budgets. `cfg`
    None: the generic family, images without keys (`check_generic`)."""
    name, keys = part.where, part.options
    if part.modality == "image":
        h, w = _check_image(part.source, name, limits)
        if keys:
            assert cfg is not None, "check_generic refuses keys first"
            factor = cfg.factor
            h, w = _keyed(name, qwen_keys.image_size, h, w, keys, factor)
            _check_keyed_image(name, h, w, cfg)
        return
    if isinstance(part.source, list):
        check_frame_count(part, limits, cfg)
        for k, frame in enumerate(part.source):
            check_frame(part, k, frame, limits, cfg)
        return
    from mmferry.preprocess.video import sample_indices
    from mmferry.preprocess.video_decode import probe_video

    assert cfg is not None, "check_generic refuses videos first"
    temporal, factor = cfg.temporal_patch_size, cfg.factor
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
    if keys:
        h, w = _keyed(name, qwen_keys.video_size, sampled, info.height, info.width, keys, factor)
        _check_keyed_video(name, sampled, h, w, cfg)
