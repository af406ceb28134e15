"""`CacheClient`: the cache routes of an `mmferry serve` endpoint (server/ec.py), as an
engine's connector calls them: which hashes it holds, and their `[main | ds...]` rows."""

from __future__ import annotations

from typing import Any

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ServiceUnavailable(RuntimeError):
    """The service did not answer (down, restarting, or refused the request)."""


class CacheClient:
    """The three cache routes of one `mmferry serve` endpoint (blocking httpx)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float, shm: bool) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)
        self._errors = (httpx.HTTPError, OSError, ValueError)
        self.shm = shm

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        try:
            r = self._http.post(route, json=body)
        except self._errors as e:
            raise ServiceUnavailable(f"{route}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ServiceUnavailable(f"{route}: {r.status_code} {r.text[:200]}")
        return r

    def lookup(self, hashes: list[str]) -> list[bool]:
        """Which hashes the service holds (and has now pinned for us)."""
        return self._post("/v1/cache/lookup", {"hashes": hashes}).json()["present"]

    def load(self, hashes: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Rows per hash: read-only shared-memory views, or tensors parsed from safetensors."""
        body = {"hashes": hashes, "dtype": DTYPE_NAMES[dtype]}
        if self.shm:
            body["response"] = "shm"
        r = self._post("/v1/cache/load", body)
        if not self.shm:
            from safetensors.torch import load

            return load(r.content)
        from mmferry.server.client import open_handle

        return {h: open_handle(doc) for h, doc in r.json()["items"].items()}

    def close(self) -> None:
        self._http.close()
