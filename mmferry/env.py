"""Every environment variable mmferry reads, in one typed place (prefix `MMFERRY_`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "MMFERRY_"


@dataclass(frozen=True)
class Env:
    """Settings taken from the environment rather than the command line."""

    # Threads a preprocessing call uses when it does not say (see preprocess/threads.py).
    preprocess_threads: int | None = None
    # Freed preprocessing buffers kept for reuse, in MiB (0: none; see preprocess/buffers.py).
    host_cache_mb: int = 2048
    # The encoder service's API key. Kept out of argv so it does not show in process lists.
    api_key: str | None = None
    # `mmferry proxy`: the key it sends the encoders, and the one it sends the engine.
    encoder_api_key: str | None = None
    llm_api_key: str | None = None
    # Set by torchrun (not ours to rename): this process's place in the group.
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        """The settings in `environ` (default: this process's environment)."""
        env = os.environ if environ is None else environ
        return cls(
            preprocess_threads=_int(env, f"{PREFIX}PREPROCESS_THREADS", None, 1),
            host_cache_mb=_int(env, f"{PREFIX}HOST_CACHE_MB", 2048, 0) or 0,
            api_key=env.get(f"{PREFIX}API_KEY") or None,
            encoder_api_key=env.get(f"{PREFIX}ENCODER_API_KEY") or None,
            llm_api_key=env.get(f"{PREFIX}LLM_API_KEY") or None,
            world_size=int(env.get("WORLD_SIZE", "1")),
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )


def _int(env: Mapping[str, str], name: str, default: int | None, least: int) -> int | None:
    """The integer `name` holds (at least `least`), or `default` when it is unset or blank."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        what = "a positive integer" if least == 1 else f"an integer of at least {least}"
        raise ValueError(f"{name} must be {what}, got {raw!r}")
    return value
