"""Whether a timestamped video keeps the chat template's outer `<|vision_start|>`/`<|vision_end|>`.

Qwen3-VL's chat templates write a video as `<|vision_start|><|video_pad|><|vision_end|>`, and
each frame expands to `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`. Whether the
template's own pair stays around all frames depends on the transformers release:
- 4.57 (the processor Qwen3-VL was released with) to 5.9 replace the whole triplet: no outer
  pair, the form the models were released with;
- 5.10 to 5.24 replace the bare pad, so the pair stays (2 ids more per video);
- 5.25 and later collapse the triplet to the bare pad before expanding: no outer pair again.
Engines build their own prompts: vLLM (0.32 to 0.34) keeps the pair with transformers >= 5.10
and SGLang 0.5.23 always keeps it. mmferry's rows fit either form (a video's pad count is the
same); only the ids and positions around them differ.

`"auto"` follows the transformers installed beside mmferry (read from its package metadata, not
imported), so the ids equal what that release's processor gives; without transformers it drops
the pair, the models' own form.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Literal, get_args

VideoWrapper = Literal["auto", "keep", "drop"]
WRAPPERS: tuple[str, ...] = get_args(VideoWrapper)

# transformers releases whose Qwen3-VL processor keeps the outer pair: [first, end).
_KEPT_FROM, _KEPT_UNTIL = (5, 10), (5, 25)


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("5.25.0", "5.26.0.dev0"); None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def kept_by(version: str | None) -> bool:
    """Whether the transformers release `version` (None: not installed) keeps the outer pair."""
    release = None if version is None else _release(version)
    return release is not None and _KEPT_FROM <= release < _KEPT_UNTIL


@functools.cache
def _installed_transformers() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def keeps_outer_pair(wrapper: VideoWrapper) -> bool:
    """Whether expansion keeps the template's pair around a timestamped video's frames."""
    if wrapper not in WRAPPERS:
        raise ValueError(f"video_wrapper must be one of {', '.join(WRAPPERS)}; got {wrapper!r}")
    if wrapper == "auto":
        return kept_by(_installed_transformers())
    return wrapper == "keep"
