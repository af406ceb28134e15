"""A request's work cancelled when its client goes away before the answer.

The ASGI server does not stop a handler whose client has left: the handler runs on until it
writes its answer (to nobody). Once the body has been read, the server's `receive()` returns
only when the connection closes (`http.disconnect`), so a watcher awaiting it beside the work
learns that the client left; the work is then cancelled, and each await it stood in cleans up
as it unwinds (an encoder's or the engine's HTTP request closed, queued preprocessing dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def _disconnected(receive: Receive) -> None:
    """Returns once the client's connection is gone."""
    while (await receive())["type"] != "http.disconnect":
        # NOTE: the body was read whole before the work began: any other message is an empty
        # remainder of it, not something to act on.
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; if the client leaves first, `work` is cancelled (and has unwound)
    and starlette's ClientDisconnect is raised. `receive` is the request's ASGI receive,
    its body already read."""
    from starlette.requests import ClientDisconnect

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()  # the watcher ended first: the client is gone
    finally:
        # NOTE: the watcher never outlives this call: a response that streams listens for the
        # disconnect itself, and two readers of one connection would split its messages.
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        if not task.done():
            task.cancel()
            # Its cleanup (closing what it opened) ends before the request is answered.
            await asyncio.gather(task, return_exceptions=True)
    if left:
        raise ClientDisconnect()
    return task.result()
