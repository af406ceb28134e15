"""`EncoderClient` / `AsyncEncoderClient`: call an `mmferry serve` endpoint (httpx).

    client = EncoderClient("http://127.0.0.1:8000")
    items = client.encode([image_part("cat.jpg"), video_part("clip.mp4")])
    items[0].embeds, items[0].deepstack, items[0].grid_thw, items[0].num_tokens, items[0].hash

`shm=True` (a client on the server's host) gets shared-memory handles instead of bytes and
opens them as zero-copy, copy-on-write views (a write stays this client's own).
"""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmferry.server.encoded import EncodedItem, from_bytes


class EncodeError(RuntimeError):
    """The server refused or failed a request: its status, error kind and message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ImportError("the encoder client needs httpx: pip install 'mmferry[server]'") from None
    return httpx


def _part(kind: str, source: str | Path | bytes, mime: str | None) -> dict[str, Any]:
    modality = kind.removesuffix("_url")
    if isinstance(source, (str, Path)) and not isinstance(source, bytes):
        text = str(source)
        if text.startswith(("data:", "http://", "https://", "file:")):
            return {"type": kind, kind: {"url": text}}
        data = Path(text).read_bytes()
        mime = mime or mimetypes.guess_type(text)[0]
    else:
        data = bytes(source)
    mime = mime or ("image/png" if modality == "image" else "video/mp4")
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": kind, kind: {"url": url}}


def image_part(source: str | Path | bytes, mime: str | None = None) -> dict[str, Any]:
    """An `image_url` part: a file or bytes sent inline, or a URL passed as is."""
    return _part("image_url", source, mime)


def video_part(source: str | Path | bytes, mime: str | None = None) -> dict[str, Any]:
    """A `video_url` part: a file or bytes sent inline, or a URL passed as is."""
    return _part("video_url", source, mime)


def path_part(path: str | Path, modality: str = "image") -> dict[str, Any]:
    """A part naming a file on the server's host (inside a folder it allows)."""
    kind = f"{modality}_url"
    return {"type": kind, kind: {"url": Path(path).resolve().as_uri()}}


def _body(
    parts: Sequence[dict[str, Any]], layout: str | None, dtype: str | None, shm: bool
) -> dict:
    # No layout: the service's default (compact-u8 for native families, hf for the generic).
    body: dict[str, Any] = {"content": list(parts)}
    if layout is not None:
        body["layout"] = layout
    if dtype is not None:
        body["dtype"] = dtype
    if shm:
        body["response"] = "shm"
    return body


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def open_handle(doc: dict[str, Any]) -> Any:
    """The tensor one handle of a `"response": "shm"` answer names (an item's `embeds`, or one
    of its `deepstack`), as a zero-copy view; its bytes when the server sent them inline."""
    from mmferry.transport.shm import ShmHandle, open_shared

    fields = {k: v for k, v in doc.items() if k != "inline_b64"}
    inline = doc.get("inline_b64")
    handle = ShmHandle(
        **{**fields, "shape": tuple(fields["shape"])},
        inline=None if inline is None else base64.b64decode(inline),
    )
    return open_shared(handle)


def _parse(response: Any) -> list[EncodedItem]:
    if response.status_code != 200:
        try:
            err = response.json()["error"]
            kind, message = err["kind"], err["message"]
        except (ValueError, KeyError, TypeError):
            kind, message = "http", response.text[:200]
        raise EncodeError(response.status_code, kind, message)
    if response.headers.get("content-type", "").startswith("application/json"):
        return [
            EncodedItem(
                modality=d["modality"],
                embeds=open_handle(d["embeds"]),
                deepstack=tuple(open_handle(h) for h in d["deepstack"]),
                grid_thw=None if d["grid_thw"] is None else tuple(d["grid_thw"]),
                num_tokens=d["num_tokens"],
                hash=d["hash"],
            )
            for d in response.json()["items"]
        ]
    return from_bytes(response.content)


class EncoderClient:
    """Blocking client of one `mmferry serve` endpoint."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 120.0):
        httpx = _import_httpx()
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=_headers(api_key))

    def encode(
        self,
        parts: Sequence[dict[str, Any]],
        *,
        layout: str | None = None,
        dtype: str | None = None,
        shm: bool = False,
    ) -> list[EncodedItem]:
        """Each part's embeddings, deepstack rows, grid, token count and hash."""
        return _parse(self._http.post("/v1/encode", json=_body(parts, layout, dtype, shm)))

    def health(self) -> dict[str, Any]:
        """The server's /health document (`status` "draining" comes with a 503)."""
        return _health(self._http.get("/health"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _health(r: Any) -> dict[str, Any]:
    # NOTE: a draining server answers 503 (so load balancers stop sending) with the document.
    if r.status_code != 503:
        r.raise_for_status()
    return r.json()


class AsyncEncoderClient:
    """The same client for asyncio code."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 120.0):
        httpx = _import_httpx()
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, headers=_headers(api_key)
        )

    async def encode(
        self,
        parts: Sequence[dict[str, Any]],
        *,
        layout: str | None = None,
        dtype: str | None = None,
        shm: bool = False,
    ) -> list[EncodedItem]:
        """Each part's embeddings, deepstack rows, grid, token count and hash."""
        body = _body(parts, layout, dtype, shm)
        return _parse(await self._http.post("/v1/encode", json=body))

    async def health(self) -> dict[str, Any]:
        """The server's /health document (`status` "draining" comes with a 503)."""
        return _health(await self._http.get("/health"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
