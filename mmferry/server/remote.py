"""Fetches from allowed hosts: their own bounded concurrency, and one deadline each.

Fetches run on the event loop (httpx's async client), not on the preprocessing threads, so an
origin that answers slowly holds a fetch slot, never a thread that `data:` and local parts
need. At most `concurrency` fetches run at once; each has `timeout_s` in all, the wait for a
slot included (504), whatever the origin's pace: a byte every half second passes any per-read
timeout, not this one.
"""

from __future__ import annotations

import asyncio
from http.cookiejar import CookieJar, CookiePolicy
from typing import Any

from mmferry.server.limits import RequestError, shown, too_large


class _NoCookies(CookiePolicy):
    """Neither keep nor send cookies: one client's fetch must not carry into another's."""

    netscape = True
    rfc2965 = hide_cookie2 = False

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False

    def return_ok(self, cookie: Any, request: Any) -> bool:
        return False

    def domain_return_ok(self, domain: str, request: Any) -> bool:
        return False

    def path_return_ok(self, path: str, request: Any) -> bool:
        return False


class RemoteFetcher:
    """GETs of checked URLs (allowed hosts only), `concurrency` at a time, `timeout_s` each."""

    def __init__(self, concurrency: int, timeout_s: float, max_bytes: int) -> None:
        if concurrency < 1 or not timeout_s > 0:
            raise ValueError("fetch concurrency must be at least 1 and the timeout positive")
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._slots = asyncio.Semaphore(concurrency)
        self._client: Any = None

    async def fetch(self, url: str, where: str) -> bytes:
        """The body `url` answers with; 504 past the deadline, 502 for a failed fetch. `where`
        names the part in messages ("part 2", "message 1 part 0")."""
        try:
            return await asyncio.wait_for(self._fetch(url, where), self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(
                504,
                "fetch_timeout",
                f"{where}: fetching {shown(url)} took more than "
                f"fetch_timeout_s={self.timeout_s:g} (--fetch-timeout)",
            ) from None

    async def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        async with self._slots:
            data = bytearray()
            try:
                async with self._http().stream("GET", url) as r:
                    if r.status_code != 200:
                        raise RequestError(
                            502,
                            "fetch_failed",
                            f"{where}: {shown(url)} answered {r.status_code}",
                        )
                    async for chunk in r.aiter_bytes():
                        data += chunk
                        if len(data) > self.max_bytes:
                            what = f"{where} ({shown(url)})"
                            raise too_large(what, len(data), "max_request_bytes", self.max_bytes)
            except httpx.InvalidURL as e:
                raise RequestError(
                    400, "bad_url", f"{where}: malformed URL {shown(url)} ({e})"
                ) from None
            except httpx.HTTPError as e:
                raise RequestError(
                    502, "fetch_failed", f"{where}: fetching {shown(url)} failed ({e})"
                ) from None
        return bytes(data)

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            # NOTE: no timeout of httpx's own: the deadline above bounds the whole fetch, and
            # a shorter per-read one would only fire first with a vaguer message.
            self._client = httpx.AsyncClient(
                timeout=None, follow_redirects=False, cookies=CookieJar(policy=_NoCookies())
            )
        return self._client

    async def close(self) -> None:
        """Close the connections kept for reuse."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
