"""A steady stream of chat requests through a front (the proxy), each recorded with its start,
end and status, while the test cuts and restores links between the hosts."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from PIL import Image


@dataclass
class Done:
    image: int
    start: float
    end: float
    status: int
    text: str = ""

    @property
    def took(self) -> float:
        return self.end - self.start


def image_part(seed: int, side: int = 56) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def body(part: dict, n: int) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what"}]}],
        "max_tokens": 2,
        "user": str(n),
    }


class Load:
    """Requests at `rate` per second to URL, image i % len(parts) for the i-th, each on its own
    thread (so a stuck one holds up none after it), until `stop()`; `done` has them all, each
    with its whole answer. `make(part, n)` builds the n-th body (`body` unless given)."""

    def __init__(
        self,
        url: str,
        parts: list[dict],
        rate: float,
        timeout_s: float,
        make: Callable[[dict, int], dict] = body,
    ) -> None:
        self.url, self.parts, self.rate, self.timeout_s = url, parts, rate, timeout_s
        self.make = make
        self.done: list[Done] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self._main = threading.Thread(target=self._run, daemon=True)
        self._main.start()

    def _one(self, n: int) -> None:
        i = n % len(self.parts)
        start = time.monotonic()
        try:
            r = httpx.post(
                f"{self.url}/v1/chat/completions",
                json=self.make(self.parts[i], n),
                timeout=self.timeout_s,
            )
            status, text = r.status_code, r.text
        except httpx.HTTPError as e:
            status, text = 0, f"{type(e).__name__}: {e}"
        with self._lock:
            self.done.append(Done(i, start, time.monotonic(), status, text))

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, args=(n,), daemon=True)
            t.start()
            self._threads.append(t)
            n += 1
            self._stop.wait(max(self.t0 + n / self.rate - time.monotonic(), 0))

    def stop(self) -> list[Done]:
        self._stop.set()
        self._main.join()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        return sorted(self.done, key=lambda d: d.start)


def down_then_used_again(
    host: Any, served: Callable[[], float], down_s: float, wait_s: float = 45.0
) -> tuple[float, float, float | None]:
    """`host`'s link down for `down_s` (its process lives on), then up until `served()` (its
    count of requests served) grows: the times of the cut, of the link back and of its first
    request served after it (None: not within `wait_s`; the proxy's probe backoff reaches 30 s
    at most)."""
    cut = time.monotonic()
    host.down()
    time.sleep(down_s)
    host.up()
    back = time.monotonic()
    count_at_back = None
    deadline = back + wait_s
    while time.monotonic() < deadline:
        try:
            count = served()
        except Exception:  # noqa: BLE001 - the host unreachable from here a moment after up
            time.sleep(0.5)
            continue
        if count_at_back is None:
            count_at_back = count
        elif count > count_at_back:
            return cut, back, time.monotonic()
        time.sleep(0.5)
    return cut, back, None
