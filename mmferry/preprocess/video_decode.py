"""Video files -> the sampled frames as RGB uint8, decoded with PyAV (the `video` extra).

Inter-frame codecs decode every frame from the last keyframe, but no further back: when a
keyframe lies between the decoder's position and the next wanted frame, the decoder seeks to
it instead of decoding the frames in between. Frames are matched by their presentation
times, and the frame a seek lands on must be one the decoder calls a keyframe (the
container's flags alone are not trusted), so the pixels are those of a decode from the start;
when either check fails, the clip is decoded from the start instead. Each wanted frame is
resized as it is decoded, so a clip never holds more than its resized frames plus one decoded
frame.

Frame i is the i-th frame a decode from the start yields: frames an MP4 edit list discards
(pre-roll kept only as references) count for neither indices nor times, and times are
presentation times from the first frame shown.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.patchify import resize_u8


def import_av() -> Any:
    """PyAV, or an ImportError saying how to install it."""
    try:
        import av
    except ImportError:
        raise ImportError("decoding video files needs PyAV: pip install 'mmferry[video]'") from None
    return av


@dataclass(frozen=True)
class VideoInfo:
    total_frames: int
    fps: float
    height: int
    width: int
    # Each frame's presentation time in seconds from the first frame, when every packet has
    # one (variable-frame-rate files need them); None otherwise.
    times: tuple[float, ...] | None = None
    # Presentation timestamps (stream time base) of the frames, and which frames are keyframes.
    pts: tuple[int, ...] | None = None
    keyframes: tuple[int, ...] = ()


def _open(av: Any, data: bytes, name: str) -> tuple[Any, Any]:
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ValueError(f"cannot decode video {name}: not a readable video ({e})") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"cannot decode video {name}: it has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        tag = getattr(stream, "codec_tag", "") or "unknown"
        container.close()
        raise ValueError(f"cannot decode video {name}: its codec ({tag}) is not supported")
    return container, stream


def probe_video(data: bytes, name: str) -> VideoInfo:
    """Frame count, frame rate, size, and each frame's time and keyframe flag (one demux)."""
    av = import_av()
    if not data:
        raise ValueError(f"cannot decode video {name}: it is empty")
    container, stream = _open(av, data, name)
    with container:
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        try:
            # NOTE: a packet an edit list discards (pre-roll decoded only as a reference) gives
            # no frame, and a demuxer drops from its index whole GOPs before the edit, so the
            # header's frame count can be larger than what a decode yields: the frames are
            # the packets that are kept.
            packets = [
                (p.pts, p.is_keyframe)
                for p in container.demux(stream)
                if p.size and not p.is_discard
            ]
        except (av.FFmpegError, OSError, ValueError) as e:
            raise ValueError(f"cannot decode video {name}: corrupt ({e})") from None
        total = len(packets)
        height, width = stream.codec_context.height, stream.codec_context.width
        time_base = stream.time_base
    if total < 1:
        raise ValueError(f"cannot decode video {name}: it has no frames")
    if not rate:
        raise ValueError(f"cannot decode video {name}: no frame rate; pass source_fps=")
    pts = sorted(p for p, _ in packets if p is not None)
    # NOTE: packet times in presentation order are the frames' times only when every frame
    # has its own packet with a distinct time; otherwise times and seeking are not used.
    if len(pts) != total or len(set(pts)) != total or time_base is None:
        return VideoInfo(int(total), float(rate), int(height), int(width))
    index = {p: i for i, p in enumerate(pts)}
    keyframes = tuple(sorted(index[p] for p, key in packets if key and p is not None))
    base = Fraction(time_base)
    times = tuple(float((p - pts[0]) * base) for p in pts)
    return VideoInfo(int(total), float(rate), int(height), int(width), times, tuple(pts), keyframes)


class _SeekMissed(Exception):
    """The decoder did not return the wanted frame after a seek; decode from the start."""


def decode_frames(
    data: bytes,
    name: str,
    indices: list[int],
    check_size: Callable[[int, int], None],
    target_size: Callable[[int, int], tuple[int, int]],
    info: VideoInfo | None = None,
) -> torch.Tensor:
    """The frames at `indices` (ascending, repeats allowed), each resized to
    `target_size(h, w)` as it is decoded, as [n, 3, h', w'] uint8 (channels-last memory)."""
    av = import_av()
    can_seek = info is not None and info.pts is not None and bool(info.keyframes)
    if can_seek:
        try:
            return _decode(av, data, name, indices, check_size, target_size, info)
        except _SeekMissed:
            pass
    return _decode(av, data, name, indices, check_size, target_size, None)


def _decode(
    av: Any,
    data: bytes,
    name: str,
    indices: list[int],
    check_size: Callable[[int, int], None],
    target_size: Callable[[int, int], tuple[int, int]],
    info: VideoInfo | None,
) -> torch.Tensor:
    container, stream = _open(av, data, name)
    wanted: dict[int, list[int]] = {}
    for slot, idx in enumerate(indices):
        wanted.setdefault(idx, []).append(slot)
    out: np.ndarray | None = None
    size: tuple[int, int] = (0, 0)
    pos, seen, frames = 0, 0, container.decode(stream)
    landed = True  # False from a seek until the decoder shows it landed on a keyframe
    keyframes = np.asarray(info.keyframes) if info is not None else None

    def take(frame: Any, slots: list[int]) -> None:
        nonlocal out, size
        if out is None:
            check_size(frame.height, frame.width)
            size = (frame.height, frame.width)
            new_h, new_w = target_size(frame.height, frame.width)
            # Written through numpy: single-threaded copies beside the decoder's threads.
            out = empty_host((len(indices), new_h, new_w, 3), torch.uint8).numpy()
        elif (frame.height, frame.width) != size:
            raise ValueError(
                f"video {name} changes frame size mid-stream ({size} -> "
                f"{(frame.height, frame.width)})"
            )
        hwc = torch.from_numpy(frame.to_ndarray(format="rgb24"))
        # [H, W, 3] -> [1, 3, H, W] channels-last view -> resized [1, 3, h', w']
        small = resize_u8(hwc.unsqueeze(0).permute(0, 3, 1, 2), *out.shape[1:3])
        for s in slots:
            out[s] = small[0].permute(1, 2, 0).numpy()

    with container:
        try:
            for idx in sorted(wanted):
                at = 0 if keyframes is None else int(np.searchsorted(keyframes, idx, "right"))
                if at > 0:
                    key = int(keyframes[at - 1])  # the last keyframe at or before idx
                    if key > pos:  # it lies ahead of the decoder: skip the frames before it
                        container.seek(info.pts[key], backward=True, stream=stream)
                        frames, pos, landed = container.decode(stream), key, False
                for frame in frames:
                    if keyframes is not None and frame.pts != info.pts[pos]:
                        if frame.pts is not None and frame.pts < info.pts[pos]:
                            continue  # a leading frame of an open GOP, before the seek point
                        raise _SeekMissed
                    if not landed:
                        # NOTE: a container's keyframe flags can be wrong (an MP4 without a
                        # sync-sample table flags every packet); only the decoder knows that
                        # the frame a seek lands on needed no earlier frame. Trusting the
                        # flags returns frames decoded without their references.
                        if not frame.key_frame:
                            raise _SeekMissed
                        landed = True
                    pos += 1
                    seen = max(seen, pos)
                    if pos - 1 == idx:
                        take(frame, wanted[idx])
                        break
                else:
                    break
        except (av.FFmpegError, OSError) as e:
            raise ValueError(f"cannot decode video {name}: corrupt ({e})") from None
    last = indices[-1]
    if out is None or seen <= last:
        if keyframes is not None:
            raise _SeekMissed
        raise ValueError(
            f"cannot decode video {name}: truncated or corrupt (decoded {seen} frame(s), "
            f"needed frame {last})"
        )
    return torch.from_numpy(out).permute(0, 3, 1, 2)
