"""Video files -> the sampled frames as RGB uint8, decoded with PyAV (the `video` extra).

Every frame up to the last sampled one must pass through the decoder (inter-frame codecs),
but only sampled frames are converted to RGB and copied out.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmferry.preprocess.buffers import empty_host


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


def _open(av: Any, data: bytes, name: str) -> tuple[Any, Any]:
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ValueError(f"cannot decode video {name}: not a readable video ({e})") from None
    if not container.streams.video:
        container.close()
        raise ValueError(f"cannot decode video {name}: it has no video stream")
    stream = container.streams.video[0]
    return container, stream


def probe_video(data: bytes, name: str) -> VideoInfo:
    """Frame count, frame rate and size from the container (counting packets if not stored)."""
    av = import_av()
    if not data:
        raise ValueError(f"cannot decode video {name}: it is empty")
    container, stream = _open(av, data, name)
    with container:
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        total = stream.frames
        try:
            if not total:
                total = sum(1 for p in container.demux(stream) if p.size)
        except (av.FFmpegError, OSError, ValueError) as e:
            raise ValueError(f"cannot decode video {name}: corrupt ({e})") from None
        height, width = stream.codec_context.height, stream.codec_context.width
    if total < 1:
        raise ValueError(f"cannot decode video {name}: it has no frames")
    if not rate:
        raise ValueError(f"cannot decode video {name}: no frame rate; pass source_fps=")
    return VideoInfo(int(total), float(rate), int(height), int(width))


def decode_frames(
    data: bytes, name: str, indices: list[int], check_size: Callable[[int, int], None]
) -> torch.Tensor:
    """The frames at `indices` (ascending, repeats allowed) as [n, H, W, 3] uint8."""
    av = import_av()
    container, stream = _open(av, data, name)
    wanted: dict[int, list[int]] = {}
    for slot, idx in enumerate(indices):
        wanted.setdefault(idx, []).append(slot)
    last = indices[-1]
    out: torch.Tensor | None = None
    out_np: Any = None
    seen = 0
    with container:
        try:
            for i, frame in enumerate(container.decode(stream)):
                seen = i + 1
                slots = wanted.get(i)
                if slots is not None:
                    if out is None:
                        check_size(frame.height, frame.width)
                        out = empty_host((len(indices), frame.height, frame.width, 3), torch.uint8)
                        # Written through numpy: single-threaded copies beside the decoder's
                        # threads, without waking torch's intra-op pool per frame.
                        out_np = out.numpy()
                    elif (frame.height, frame.width) != tuple(out.shape[1:3]):
                        raise ValueError(
                            f"video {name} changes frame size mid-stream "
                            f"({tuple(out.shape[1:3])} -> {(frame.height, frame.width)})"
                        )
                    rgb = frame.to_ndarray(format="rgb24")
                    for s in slots:
                        out_np[s] = rgb
                if i >= last:
                    break
        except (av.FFmpegError, OSError) as e:
            raise ValueError(f"cannot decode video {name}: corrupt ({e})") from None
    if out is None or seen <= last:
        raise ValueError(
            f"cannot decode video {name}: truncated or corrupt (decoded {seen} frame(s), "
            f"needed frame {last})"
        )
    return out
