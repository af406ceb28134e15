"""Rows pushed to SGLang's language side over ZMQ (the `sglang` extra: pyzmq), and the receive
addresses its scheduler ranks register.

`zmq_to_tokenizer`: `/encode` names the address (`prefill_host:embedding_port`), one push.
`zmq_to_scheduler`: `/encode` names none; each scheduler rank posts its address to
`/scheduler_receive_url` with the part's `req_id` and how many ranks will (`receive_count`),
before or after `/encode`, and every rank gets the part. Addresses wait here (bounded in time)
until the part is ready, and a part waits for its addresses likewise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mmferry.server")

# How long a registered address waits for its part, and a part for its addresses: SGLang's
# language side gives up on a request after SGLANG_ENCODER_RECV_TIMEOUT (180 s by default).
WAIT_S = 180.0


def import_zmq() -> Any:
    """pyzmq, or an ImportError naming the extra."""
    try:
        import zmq
    except ImportError:
        raise ImportError(
            "serving SGLang's language servers needs pyzmq: pip install 'mmferry[sglang]'"
        ) from None
    return zmq


def tcp(address: str) -> str:
    """`host:port` (or `[v6]:port`) as a ZMQ endpoint."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class Pusher:
    """Sends one message (a list of frames) to one endpoint, on a worker thread: a PUSH socket
    connected for it, the send bounded by `timeout_s` (a receiver that is gone fails it)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self._zmq = import_zmq()
        self._ctx = self._zmq.Context()
        self.timeout_s = timeout_s

    async def push(self, address: str, frames: Sequence[Any]) -> None:
        await asyncio.to_thread(self._send, tcp(address), list(frames))

    def _send(self, endpoint: str, frames: list[Any]) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.PUSH)
        try:
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            # NOTE: IMMEDIATE: queue nothing for a peer that is not connected, so a send to a
            # receiver that has gone times out here instead of waiting in a queue forever.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.connect(endpoint)
            try:
                tracker = sock.send_multipart(frames, copy=False, track=True)
            except zmq.Again:
                raise TimeoutError(
                    f"{endpoint} took no message within {self.timeout_s} s"
                ) from None
            # The frames' buffers are zmq's until the tracker fires: the caller keeps them.
            tracker.wait(self.timeout_s)
        finally:
            sock.close(linger=int(self.timeout_s * 1000))

    def close(self) -> None:
        self._ctx.term()


@dataclass
class _Entry:
    count: int = 0  # ranks that will register (the largest `receive_count` seen)
    addresses: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class Destinations:
    """The addresses registered per part `req_id` (`zmq_to_scheduler`)."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.wait_s = wait_s
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, req_id: str) -> _Entry:
        now = time.monotonic()
        # Addresses of parts that never came (their /encode refused before it ran) go.
        stale = [k for k, e in self._entries.items() if now - e.created > 2 * self.wait_s]
        for k in stale:
            del self._entries[k]
        return self._entries.setdefault(req_id, _Entry())

    def register(self, req_id: str, count: int, address: str) -> None:
        entry = self._entry(req_id)
        entry.count = max(entry.count, count)
        if address not in entry.addresses:
            entry.addresses.append(address)
        if len(entry.addresses) >= entry.count:
            entry.complete.set()

    async def take(self, req_id: str) -> tuple[list[str], bool]:
        """The ranks' addresses once all have registered, or those that did within `wait_s`,
        and whether all did; the entry is forgotten."""
        entry = self._entry(req_id)
        try:
            await asyncio.wait_for(entry.complete.wait(), self.wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._entries.pop(req_id, None)
        return list(entry.addresses), entry.complete.is_set()
