"""Helpers for transport tests: this process's segments, mappings and reaper children."""

from __future__ import annotations

import gc
import os
import time

from mmferry.transport.segment import PREFIX


def own_segments() -> set[str]:
    """Names in /dev/shm created by this process (other processes' tests may run alongside)."""
    mine = f"{PREFIX}{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def mapped(name: str) -> bool:
    """True while this process maps the segment `name` (e.g. "/mmferry-...")."""
    with open("/proc/self/maps") as f:
        return any(("/dev/shm" + name) in line for line in f)


def mapping_of(address: int) -> str:
    """The /proc/self/maps line whose range holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line
    raise LookupError(hex(address))


def children() -> set[int]:
    """PIDs of this process's live children (reapers included)."""
    me = os.getpid()
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
                out.add(int(d))
    return out


def wait_until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        gc.collect()
        time.sleep(0.02)
    return cond()
