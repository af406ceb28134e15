"""`Streamed`: an answer relayed to the client as its chunks arrive, as an ASGI app.

What Starlette's StreamingResponse does for the proxy, at a fraction of its cost a request (it
runs the body and a wait for the client's disconnect in an anyio task group): the body is sent
in the request's task, beside one watcher of the connection (server/disconnect.py), and a client
that leaves stops it. An answer that has arrived whole by its first chunk (a JSON answer, not a
stream) goes out with its length in one write of its body, instead of as chunked framing
written three times.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mmferry.server.disconnect import unless_disconnected

# No body with these (RFC 9110 6.4.1), so no length of one either.
_BODYLESS = frozenset({204, 304})


class Streamed:
    """The answer's status, headers (lower-case names, one value each) and `chunks`;
    `whole()` says whether the chunks read so far are all of the body; `close()` runs once the
    answer has ended, however it ended (finished, failed, or the client gone); `arrived()`,
    whether the whole body is in already (then sending it waits on nothing but the client)."""

    def __init__(
        self,
        status_code: int,
        headers: dict[str, str],
        chunks: AsyncIterator[bytes],
        whole: Callable[[], bool],
        close: Callable[[], Awaitable[None]],
        arrived: Callable[[], bool],
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self.chunks = chunks
        self.whole = whole
        self.close = close
        self.arrived = arrived

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from starlette.requests import ClientDisconnect

        try:
            if self.arrived():
                # NOTE: no watcher: the answer is in, and a client gone meanwhile makes the
                # server drop what is sent (most answers that are not streams come so).
                await self._send(scope, send)
            else:
                await unless_disconnected(receive, self._send(scope, send))
        except ClientDisconnect:
            pass  # the client left: closing the answer below closes the engine's request
        finally:
            await self.close()

    async def _send(self, scope: dict[str, Any], send: Any) -> None:
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        chunks = aiter(self.chunks)
        try:
            first = await anext(chunks, b"")
            once = (
                scope["method"] != "HEAD"
                and self.status_code >= 200
                and self.status_code not in _BODYLESS
                and self.whole()
            )
            if once:
                headers.append((b"content-length", str(len(first)).encode()))
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": headers}
            )
            if once:
                await send({"type": "http.response.body", "body": first})
                return
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
