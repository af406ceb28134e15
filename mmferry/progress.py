"""`terminal_bar`: tqdm's progress bar where someone watches, nothing on a pipe or in a log.

Long work (`mmferry encode` over many files, a benchmark's rounds) shows progress on a
terminal only, so what goes to a file or a pipe is the command's own lines and nothing else.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def terminal_bar(
    total: int, unit: str, stream: TextIO | None = None, *, leave: bool = True
) -> Any | None:
    """A tqdm bar of `total` `unit`s drawn on `stream` (stderr), or None when `stream` is not
    a terminal."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None
    from tqdm import tqdm  # only where a bar is drawn: tqdm's import is not free

    return tqdm(total=total, unit=unit, file=stream, leave=leave, dynamic_ncols=True)
