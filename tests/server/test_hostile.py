"""The service against hostile clients and origins, over real HTTP: every bad input a 4xx,
slow uploads and slow origins stall nobody else."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from .conftest import Server, png, start_server
from .slow import RawUpload, SlowOrigin
from .test_service import metric

BODY_TIMEOUT_S = 3  # --body-timeout and --fetch-timeout here; stalls below last a minute
FETCH_TIMEOUT_S = 3
MAX_QUEUE = 4
MAX_FRAMES = 24
FETCH_CONCURRENCY = 2
SLOW_S = 10  # far above either deadline, far below the minute a stall lasts


@pytest.fixture(scope="module")
def origin() -> Iterator[SlowOrigin]:
    with SlowOrigin(png(48, 48, seed=5)) as o:
        yield o


@pytest.fixture(scope="module")
def hostile(media_dir, origin) -> Iterator[Server]:
    s = start_server(
        [
            *("--allow-path", str(media_dir), "--allow-host", origin.host),
            *("--allow-host", "h", "--limit-pixels", str(1_000_000), "--shm-mib", "0"),
            # --max-frames: the old spelling of --limit-frames, still accepted
            *("--max-queue", str(MAX_QUEUE), "--max-frames", str(MAX_FRAMES)),
            *("--body-timeout", str(BODY_TIMEOUT_S), "--fetch-timeout", str(FETCH_TIMEOUT_S)),
            *("--fetch-concurrency", str(FETCH_CONCURRENCY)),
        ]
    )
    yield s
    s.stop()


def _post(url: str, body: bytes, ctype: str = "application/json") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/encode", content=body, headers={"content-type": ctype}, timeout=120
    )


def _img(url: str, modality: str = "image") -> bytes:
    part = {"type": f"{modality}_url", f"{modality}_url": {"url": url}}
    return json.dumps({"content": [part]}).encode()


def _data(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with(extra: bytes, width: int = 4, height: int = 4) -> bytes:
    """A PNG with `extra` chunks before its pixels; the header may declare any size."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = b"".join(b"\0" + bytes(3 * 4) for _ in range(4))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + extra
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def _clip(frames: int, fps: int = 30, size: int = 32) -> bytes:
    """An MPEG-4 clip of `frames` small frames at `fps`."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size, size, 3), (i * 7) % 256, np.uint8)
            for pkt in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)
    return buf.getvalue()


def _bad_inputs(media_dir, origin) -> dict[str, tuple[bytes, int, str]]:
    bomb = zlib.compress(bytes(8 << 20))  # inflates past Pillow's 1 MiB text-chunk limit
    ppm = b"P6\nabc 4\n255\n" + bytes(48)
    huge = _png_with(b"", 20_000, 10_000)  # 2e8 pixels: past Pillow's own limit
    deep = ("[" * 500 + "]" * 500).encode()
    return {
        "JSON nested 100,000 deep": (b"[" * 100_000, 400, "nested"),
        "a 5,000-digit integer": (b'{"content": [], "n": ' + b"9" * 5000 + b"}", 400, "JSON"),
        "type is a list": (b'{"content": [{"type": ["image_url"]}]}', 422, "type"),
        "type is an object": (b'{"content": [{"type": {}}]}', 422, "type"),
        "a 100,000-character type": (
            json.dumps({"content": [{"type": "x" * 100_000}]}).encode(),
            422,
            "type",
        ),
        "an option nested 500 deep": (
            _img(f"{media_dir}/img0.png")[:-1] + b', "layout": ' + deep + b"}",
            422,
            "layout",
        ),
        "port over 65535": (_img("http://h:99999/x"), 400, "port"),
        "port not a number": (_img("http://h:abc/x"), 400, "port"),
        "unclosed IPv6 host": (_img("http://[::1/x"), 400, "URL"),
        "NUL byte in a path": (_img(f"{media_dir}/img0\0.png"), 400, "NUL"),
        "%00 in a file URL": (_img(f"file://{media_dir}/img0%00.png"), 400, "NUL"),
        "5,000-character path component": (
            _img(f"{media_dir}/{'a' * 5000}.png"),
            400,
            "too long",
        ),
        "control character in an allowed-host URL": (
            _img(f"http://{origin.host}/img\x01.png"),
            400,
            "control",
        ),
        "newline in an allowed-host URL": (_img(f"http://{origin.host}/i\nmg.png"), 400, "control"),
        # Host `origin.host` to urllib and httpx, 169.254.169.254 to a WHATWG parser.
        "backslash before an allowed host": (
            _img(f"http://169.254.169.254\\@{origin.host}/img0.png"),
            400,
            "backslash",
        ),
        "PNG zTXt chunk bomb": (_img(_data(_png_with(_chunk(b"zTXt", b"k\0\0" + bomb)))), 422, ""),
        "PNG iCCP chunk bomb": (_img(_data(_png_with(_chunk(b"iCCP", b"p\0\0" + bomb)))), 422, ""),
        "PPM with a non-numeric width": (_img(_data(ppm, "image/x-portable-pixmap")), 422, ""),
        "image over Pillow's pixel limit": (_img(_data(huge)), 422, "--limit-pixels"),
    }


def test_malformed_requests_get_a_4xx_naming_the_problem(hostile, media_dir, origin):
    good = _img((media_dir / "img0.png").as_posix())
    for name, (body, status, words) in _bad_inputs(media_dir, origin).items():
        r = _post(hostile.url, body)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        message = r.json()["error"]["message"]
        assert words.lower() in message.lower(), (name, message)
        assert len(message) < 1000, (name, len(message))  # never the client's input echoed whole
        assert _post(hostile.url, good).status_code == 200, name  # still serving
    assert "Traceback" not in "".join(hostile.lines)


def test_schemes_and_media_types_are_case_insensitive(hostile, media_dir, origin):
    path = (media_dir / "img0.png").as_posix()
    data = (media_dir / "img0.png").read_bytes()
    accepted = {
        "FILE: URL": (_img(f"FILE://{path}"), "application/json"),
        "File: URL": (_img(f"File://{path}"), "application/json"),
        "HTTP: URL": (_img(f"HTTP://{origin.host}/img.png"), "application/json"),
        "DATA:IMAGE/PNG;BASE64": (_img(_data(data, "IMAGE/PNG").replace("base64", "BASE64")), ""),
        "Application/JSON": (_img(path), "Application/JSON"),
        "charset parameter": (_img(path), "application/json; Charset=UTF-8"),
        "quoted charset": (_img(path), 'APPLICATION/JSON;charset="utf-8"'),
    }
    for name, (body, ctype) in accepted.items():
        r = _post(hostile.url, body, ctype or "application/json")
        assert r.status_code == 200, (name, r.status_code, r.text[:300])
    r = _post(hostile.url, _img(path), "application/json; charset=latin-1")
    assert r.status_code == 415 and "utf-8" in r.json()["error"]["message"].lower()


def test_max_frames_bounds_the_sampled_frames_not_the_container(hostile):
    # 10 s at 30 fps: 300 frames in the file, 20 sampled at Qwen3-VL's 2 fps.
    r = _post(hostile.url, _img(_data(_clip(300), "video/mp4"), "video"))
    assert r.status_code == 200, r.text[:300]
    # 30 s: 60 sampled frames, more than --max-frames.
    r = _post(hostile.url, _img(_data(_clip(900), "video/mp4"), "video"))
    assert r.status_code == 422, r.text[:300]
    message = r.json()["error"]["message"]
    assert "sampled" in message and f"limit_frames={MAX_FRAMES}" in message
    assert "--limit-frames" in message


def test_max_frames_follows_the_parts_own_sampling_keys(hostile):
    clip = {"type": "video_url", "video_url": {"url": _data(_clip(300), "video/mp4")}}
    # 20 frames at the processor's 2 fps pass; the part asks for 60: more than --limit-frames.
    r = _post(hostile.url, json.dumps({"content": [{**clip, "nframes": 60}]}).encode())
    assert r.status_code == 422, r.text[:300]
    assert f"limit_frames={MAX_FRAMES}" in r.json()["error"]["message"]
    # 60 frames at 2 fps are refused; the part asks for 8 of them.
    long = {"type": "video", "video": _data(_clip(900), "video/mp4"), "nframes": 8}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, long]}]
    r = _post(hostile.url, json.dumps({"messages": messages}).encode())
    assert r.status_code == 200, r.text[:300]


def test_a_fifo_in_an_allowed_folder_is_a_404_at_once(hostile, media_dir):
    fifo = media_dir / "pipe.png"
    os.mkfifo(fifo)
    try:
        t0 = time.monotonic()
        r = _post(hostile.url, _img(fifo.as_posix()))
        assert r.status_code == 404 and "not a regular file" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < SLOW_S
    finally:
        fifo.unlink()


def test_qwen_parts_in_messages_fetch_from_allowed_hosts_only(hostile, origin):
    def body(url: str) -> bytes:
        part = {"type": "image", "image": url}
        return json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()

    assert _post(hostile.url, body(f"http://{origin.host}/img.png")).status_code == 200
    r = _post(hostile.url, body("http://example.com/img.png"))
    assert r.status_code == 403 and "--allow-host" in r.json()["error"]["message"]


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_stalled_uploads_hold_no_queue_slot_and_get_408(hostile, media_dir):
    stalled = [RawUpload(hostile.url) for _ in range(MAX_QUEUE + 1)]

    def all_seen() -> bool:
        h = _health(hostile.url)
        return h.get("reading", 0) + h["in_flight"] >= MAX_QUEUE

    _wait_for(all_seen, "the stalled uploads to reach the server")
    good = _img((media_dir / "img1.png").as_posix())
    r = _post(hostile.url, good)
    assert r.status_code == 200, r.text[:300]  # not 503 queue_full
    assert [u.status() for u in stalled] == [408] * len(stalled)

    # A body that keeps dripping is cut at the same deadline: it is a total, not per read.
    drip = RawUpload(hostile.url, declared=1000, first=b"[")
    t0 = time.monotonic()

    def trickle() -> None:
        try:
            for _ in range(200):
                time.sleep(0.25)
                drip.sock.sendall(b"0")
        except OSError:
            pass  # the server answered and closed

    threading.Thread(target=trickle, daemon=True).start()
    assert drip.status() == 408
    assert time.monotonic() - t0 < SLOW_S


def test_client_gone_mid_upload_is_a_499_without_a_traceback(hostile):
    before = metric(hostile.url, 'mmferry_requests_total{status="499"}')
    seen = len(hostile.lines)
    gone = RawUpload(hostile.url)
    _wait_for(lambda: _health(hostile.url).get("reading", 0) >= 1, "the upload to start")
    gone.sock.close()
    _wait_for(
        lambda: metric(hostile.url, 'mmferry_requests_total{status="499"}') > before,
        "the disconnect to be counted",
    )
    assert metric(hostile.url, 'mmferry_errors_total{kind="client_disconnect"}') >= 1
    assert metric(hostile.url, 'mmferry_errors_total{kind="internal"}') == 0
    time.sleep(0.5)  # anything logged with it has reached the pipe by now
    assert "Traceback" not in "".join(hostile.lines[seen:])


def test_a_slow_origin_stalls_no_unrelated_request(hostile, media_dir, origin):
    answers: list[tuple[httpx.Response, float]] = []

    def slow_fetch() -> None:
        t0 = time.monotonic()
        r = _post(hostile.url, _img(f"http://{origin.host}/stall"))
        answers.append((r, time.monotonic() - t0))

    threads = [threading.Thread(target=slow_fetch) for _ in range(FETCH_CONCURRENCY + 1)]
    for t in threads:
        t.start()
    _wait_for(lambda: origin.held >= FETCH_CONCURRENCY, "the origin to hold the fetches")
    t0 = time.monotonic()
    r = _post(hostile.url, _img(_data((media_dir / "img2.png").read_bytes())))
    assert r.status_code == 200 and time.monotonic() - t0 < SLOW_S / 2
    for t in threads:
        t.join(120)
    assert len(answers) == len(threads)
    for r, took in answers:  # the one that waited for a slot too: the deadline covers both
        assert r.status_code == 504, r.text[:300]
        assert "--fetch-timeout" in r.json()["error"]["message"]
        assert took < SLOW_S
    assert origin.peak <= FETCH_CONCURRENCY

    # One byte every 0.25 s never trips a per-read timeout; the total deadline cuts it.
    t0 = time.monotonic()
    r = _post(hostile.url, _img(f"http://{origin.host}/drip"))
    assert r.status_code == 504 and time.monotonic() - t0 < SLOW_S, r.text[:300]


def test_a_valid_jpeg_with_a_broken_exif_tag_is_encoded_upright(hostile):
    """Orientation 6 beside a numeric tag stored as text: a valid image, so 200, turned."""
    from PIL import Image

    from tests.preprocess import exif

    pixels = np.zeros((48, 80, 3), np.uint8)
    pixels[:, :40] = 255  # left half white: the turn is visible in the grid's shape
    buf = io.BytesIO()
    block = exif.exif_block(exif.orientation(6), exif.as_text(exif.X_RESOLUTION))
    Image.fromarray(pixels).save(buf, "JPEG", quality=95, exif=block)
    r = _post(hostile.url, _img(_data(buf.getvalue(), "image/jpeg")))
    assert r.status_code == 200, r.text[:300]
    from mmferry.server.encoded import from_bytes

    (item,) = from_bytes(r.content)
    _, h, w = item.grid_thw
    assert h > w, item.grid_thw  # 80 wide, 48 high stored; orientation 6 turns it upright
