"""The proxy's HTTP client toward the engine (aiohttp): one pooled session, created on the
event loop at its first request. The encoders' calls, read whole, are whole_calls.py's.

httpx spent about 0.75 ms of CPU a call here (its anyio locks, cancel scopes and URL model),
aiohttp about 0.2 ms (its HTTP parser is compiled), and a request through the proxy makes three
calls. The session follows no redirect and keeps no cookie (one client's cookie must never reach
another's request); the URL is sent as given (the proxy has already percent-encoded its path,
paths.py), and the body's bytes as the engine wrote them (no decompression).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any


def import_aiohttp() -> Any:
    """aiohttp, or an ImportError naming the extra to install."""
    try:
        import aiohttp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("mmferry proxy needs aiohttp: pip install 'mmferry[server]'") from e
    return aiohttp


def transport_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when its peer cannot be reached or breaks the connection (timeouts
    of the connection included: TimeoutError is an OSError)."""
    return (import_aiohttp().ClientError, OSError)


class Reply:
    """A response: status and headers at once; the body streamed."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.status_code: int = response.status
        self.headers = response.headers  # case-insensitive; a repeated header's values all kept

    def at_eof(self) -> bool:
        """Whether every byte of the body has been read."""
        return self._response.content.at_eof()

    def arrived(self) -> bool:
        """Whether every byte of the body has been received (read or not)."""
        return self._response.content.is_eof()

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, as the peer wrote them."""
        return self._response.content.iter_any()

    async def aclose(self) -> None:
        """The connection back to the pool if the body was read to its end, else closed (the
        peer sees the client leave: the engine aborts the request)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class Client:
    """One pooled session. `read_timeout_s`: the longest wait for any chunk of an answer (None:
    the caller puts one deadline on the whole call); `connect_timeout_s`: a connection, and a
    free place in the pool, within this."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        headers: dict[str, str] | None = None,
        decompress: bool = True,
    ) -> None:
        self._options = (connect_timeout_s, read_timeout_s, headers or {}, decompress)
        self._session: Any = None

    def _open(self) -> Any:
        aiohttp = import_aiohttp()
        connect_s, read_s, headers, decompress = self._options
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_s, sock_read=read_s),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers=headers,
            auto_decompress=decompress,
        )
        return self._session

    async def send(
        self, method: str, url: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> Reply:
        """The response once its headers are in; its body is still to be read or streamed."""
        from yarl import URL

        session = self._session or self._open()
        response = await session.request(
            method,
            URL(url, encoded=True),  # NOTE: sent as given: paths.py encoded the path already
            headers=headers,
            data=body or None,
            allow_redirects=False,
        )
        return Reply(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
