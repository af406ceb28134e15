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
# How long an encoder waits for its connection to a receive address to come up, from the
# moment `/encode` arrives (it connects while it encodes): past it the part fails at once
# (`mmferry serve --sglang-connect-timeout`). A link within a cluster connects in
# milliseconds; 2 s also covers one lost SYN (retried after 1 s).
CONNECT_S = 2.0


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


class Unreachable(ConnectionError):
    """No ZMQ connection to a receive address came up within the pusher's `connect_s`."""

    def __init__(self, address: str, cause: str, connect_s: float) -> None:
        super().__init__(f"{address}: {cause} within {connect_s:g} s")
        self.address = address
        self.cause = cause


class Link:
    """A PUSH socket connected to one receive address, the connection up (ZMQ's handshake
    done). Used from one thread at a time: `Pusher.send` closes it; `close` closes one never
    sent on."""

    def __init__(self, address: str, sock: Any, timeout_s: float) -> None:
        self.address = address
        self.sock = sock
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.sock.close(linger=0)


class Pusher:
    """Sends one message (a list of frames) to one endpoint, on worker threads: a PUSH socket
    connected for it, the connection up within `connect_s` (else `Unreachable`, naming the
    address and what the connect met), then the send bounded by `timeout_s` (a receiver gone
    since fails it)."""

    def __init__(self, timeout_s: float = 30.0, connect_s: float = CONNECT_S) -> None:
        if not connect_s > 0:
            raise ValueError(f"the SGLang connect timeout must be positive, got {connect_s}")
        self._zmq = import_zmq()
        self._ctx = self._zmq.Context()
        self.timeout_s = timeout_s
        self.connect_s = connect_s

    async def push(self, address: str, frames: Sequence[Any]) -> None:
        await self.send(await self.reach(address), frames)

    async def reach(self, address: str) -> Link:
        """A link to `address` once its connection is up; `Unreachable` after `connect_s`."""
        # NOTE: the thread is never abandoned holding a socket: a caller cancelled meanwhile
        # leaves it to finish (within connect_s), and the link it gives is closed then.
        job = asyncio.ensure_future(asyncio.to_thread(self._reach, address, tcp(address)))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(_close_link)
            raise

    async def send(self, link: Link, frames: Sequence[Any]) -> None:
        """Send `frames` on `link` and close it (its thread closes it, even if the caller is
        cancelled meanwhile)."""
        await asyncio.to_thread(self._send, link, list(frames))

    def _reach(self, address: str, endpoint: str) -> Link:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.PUSH)
        monitor, ok = None, False
        try:
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            # NOTE: IMMEDIATE: queue nothing for a peer that is not connected, so the socket is
            # writable exactly when the connection is up, and a send to a receiver that has
            # gone times out instead of waiting in a queue forever.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
            sock.connect(endpoint)
            up = sock.poll(int(self.connect_s * 1000), zmq.POLLOUT)
            seen = 0
            while monitor.poll(0):
                seen |= int.from_bytes(monitor.recv_multipart()[0][:2], "little")
            if not up:
                raise Unreachable(address, _cause(zmq, seen), self.connect_s)
            ok = True
            return Link(address, sock, self.timeout_s)
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            if not ok:
                sock.close(linger=0)

    def _send(self, link: Link, frames: list[Any]) -> None:
        zmq = self._zmq
        sock = link.sock
        try:
            try:
                tracker = sock.send_multipart(frames, copy=False, track=True)
            except zmq.Again:
                raise TimeoutError(
                    f"{link.address} took no message within {self.timeout_s} s"
                ) from None
            # The frames' buffers are zmq's until the tracker fires: the caller keeps them.
            tracker.wait(self.timeout_s)
        finally:
            sock.close(linger=int(self.timeout_s * 1000))

    def close(self) -> None:
        self._ctx.term()


def _cause(zmq: Any, seen: int) -> str:
    """What a connect that never came up met, from the socket monitor's events."""
    if seen & zmq.EVENT_CONNECTED:
        return "the TCP connection opened but no ZMQ handshake completed"
    if seen & zmq.EVENT_CONNECT_RETRIED:
        return "the connection was refused (nothing listens there)"
    return "no answer to the TCP connect (a firewall or a cut link drops it)"


def _close_link(job: asyncio.Future) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().close()


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
