"""Every environment variable mmferry reads, in one typed place (prefix `MMFERRY_`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "MMFERRY_"


@dataclass(frozen=True)
class Env:
    """Settings taken from the environment rather than the command line."""

    # The encoder service's API key. Kept out of argv so it does not show in process lists.
    api_key: str | None = None
    # Set by torchrun (not ours to rename): this process's place in the group.
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        """The settings in `environ` (default: this process's environment)."""
        env = os.environ if environ is None else environ
        return cls(
            api_key=env.get(f"{PREFIX}API_KEY") or None,
            world_size=int(env.get("WORLD_SIZE", "1")),
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
        )
