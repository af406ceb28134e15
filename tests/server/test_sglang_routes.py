"""SGLang's encoder routes on a real `mmferry serve`: `/encode` pushes a part's rows over ZMQ to
the address it names (`zmq_to_tokenizer`) or to every scheduler rank that registered on
`/scheduler_receive_url` (`zmq_to_scheduler`, in either order); refusals answer SGLang's shape
(`message`) and push the error form; bad bodies are 400s naming the field. The pickles are
read here with a stand-in unpickler (the SGLang classes mapped to local ones); SGLang's own
reader is in tests/engines/test_sglang_wire.py."""

from __future__ import annotations

import asyncio
import enum
import io
import os
import pickle
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
import zmq  # pyzmq, a dev dependency (the sglang extra): missing is a failure

from mmferry.server.sglang_wire import EMBEDDING_DATA, MODALITY
from mmferry.testing.ports import unreachable_port

from .conftest import Server, start_server


class EmbeddingData:
    pass


class Modality(enum.Enum):
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == EMBEDDING_DATA:
            return EmbeddingData
        if (module, name) == MODALITY:
            return Modality
        assert module == "torch", (module, name)
        return getattr(torch, name)


def load(frame: bytes) -> dict[str, Any]:
    return vars(_Reader(io.BytesIO(frame)).load())


@pytest.fixture(scope="module")
def server(media_dir) -> Iterator[Server]:
    s = start_server(["--allow-path", str(media_dir), "--shm-mib", "0"])
    yield s
    s.stop()


@pytest.fixture
def pull() -> Iterator[tuple[Any, int]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close(linger=0)
    ctx.term()


def body(items: list[Any], port: int | None, **over: Any) -> dict[str, Any]:
    b = {
        "req_id": f"{uuid.uuid4().hex}_local_part_0",
        "modality": "IMAGE",
        "mm_items": items,
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
        "encoder_idx": 0,
    }
    return {**b, **over}


def encode_rows(server: Server, paths: list[str]) -> torch.Tensor:
    """The same items' rows from the service's own route, packed."""
    from safetensors.torch import load as st_load

    content = [{"type": "image_url", "image_url": {"url": p}} for p in paths]
    r = httpx.post(f"{server.url}/v1/encode", json={"content": content}, timeout=60)
    assert r.status_code == 200, r.text
    t = st_load(r.content)
    rows = []
    for k in range(len(paths)):
        ds = sorted(key for key in t if key.startswith(f"{k}.deepstack."))
        parts = [t[f"{k}.embeds"], *(t[key] for key in ds)]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def test_tokenizer_backend_pushes_the_parts_rows(server, media_dir, pull):
    sock, port = pull
    paths = [str(media_dir / "img0.png"), str(media_dir / "img1.png")]
    items = [paths[0], {"url": paths[1], "detail": "auto", "content_hash": "abc"}]
    b = body(items, port, num_parts=3, part_idx=2)
    r = httpx.post(f"{server.url}/encode", json=b, timeout=60)
    assert r.status_code == 200, r.text
    head, raw = sock.recv_multipart()
    state = load(head)
    assert state["req_id"] == b["req_id"]
    assert (state["num_parts"], state["part_idx"]) == (3, 2)
    assert state["modality"] is Modality.IMAGE and state["error_msg"] is None
    assert state["dtype"] == torch.float32 and state["embedding"] is None
    rows = torch.frombuffer(bytearray(raw), dtype=state["dtype"]).reshape(state["shape"])
    want = encode_rows(server, paths)
    assert [g[0] for g in state["grid_dim"]] == [1, 1]
    tokens = sum(t * h * w // 4 for t, h, w in state["grid_dim"])
    assert rows.shape == want.shape and rows.shape[0] == tokens
    assert r.json()["embedding_size"] == rows.numel() * 4
    torch.testing.assert_close(rows, want, rtol=0, atol=0)


def test_refused_media_answers_sglangs_shape_and_pushes_the_error(server, pull):
    sock, port = pull
    b = body(["/etc/passwd"], port)
    r = httpx.post(f"{server.url}/encode", json=b, timeout=60)
    assert r.status_code == 403, r.text
    assert "outside the allowed folders" in r.json()["message"]
    (head,) = sock.recv_multipart()
    state = load(head)
    assert state["req_id"] == b["req_id"] and state["error_code"] == 403
    assert state["error_msg"] == r.json()["message"] and state["shape"] is None


@pytest.mark.parametrize("register_first", [True, False])
def test_scheduler_backend_pushes_to_every_registered_rank(server, media_dir, register_first):
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PULL) for _ in range(2)]
    try:
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in socks]
        for s in socks:
            s.setsockopt(zmq.RCVTIMEO, 30_000)
        b = body([str(media_dir / "img2.png")], None)

        def register() -> None:
            for p in ports:
                reg = {"req_id": b["req_id"], "receive_count": 2, "receive_url": f"127.0.0.1:{p}"}
                r = httpx.post(f"{server.url}/scheduler_receive_url", json=reg, timeout=30)
                assert r.status_code == 200, r.text

        if register_first:
            register()
        r = httpx.post(f"{server.url}/encode", json=b, timeout=60)
        assert r.status_code == 200, r.text
        if not register_first:
            register()
        got = [s.recv_multipart() for s in socks]
        assert got[0][0][:2] == b"\x80\x02" and got[0][1] == got[1][1]
        assert [load(g[0])["shape"] for g in got] == [load(got[0][0])["shape"]] * 2
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "over, status, words",
    [
        ({"req_id": ""}, 400, "req_id"),
        ({"modality": "TEXT"}, 400, "modality"),
        ({"num_parts": 0}, 400, "num_parts"),
        ({"part_idx": 1}, 400, "part_idx"),
        ({"mm_items": []}, 400, "mm_items"),
        ({"mm_items": [3]}, 400, "mm_items[0]"),
        ({"embedding_port": "x"}, 400, "embedding_port"),
        ({"modality": "AUDIO"}, 422, "images and videos"),
        ({"mm_items": [{"url": "/x.png", "max_dynamic_patch": 4}]}, 422, "max_dynamic_patch"),
    ],
)
def test_bad_encode_bodies_name_the_field(server, over, status, words):
    r = httpx.post(f"{server.url}/encode", json=body(["/x.png"], 5, **over), timeout=30)
    assert r.status_code == status, r.text
    assert words in r.json()["message"]


@pytest.mark.parametrize(
    "reg",
    [{}, {"req_id": "a", "receive_count": 0, "receive_url": "h:1"}, {"req_id": "a"}],
)
def test_bad_registrations_are_400s(server, reg):
    full = {"req_id": "a", "receive_count": 1, "receive_url": "no-port"} if reg == {} else reg
    r = httpx.post(f"{server.url}/scheduler_receive_url", json=full, timeout=30)
    assert r.status_code == 400, r.text


def test_destinations_wait_for_every_rank_then_give_what_came():
    import asyncio

    from mmferry.server.sglang_push import Destinations

    async def run() -> None:
        d = Destinations(wait_s=0.2)
        d.register("a", 2, "h:1")
        d.register("a", 2, "h:1")  # a rank posting twice is one rank
        assert await d.take("a") == (["h:1"], False)  # the other never came
        task = asyncio.ensure_future(d.take("b"))
        await asyncio.sleep(0.01)
        d.register("b", 2, "h:1")
        d.register("b", 2, "h:2")
        assert await task == (["h:1", "h:2"], True)
        assert len(d) == 0

    asyncio.run(run())


def test_a_part_is_counted_sent_when_sglang_hangs_up_on_the_rows(media_dir, pull):
    """SGLang's tokenizer cancels its `/encode` call as soon as the rows reach it, often before
    the push has returned in the service: the part is still counted as sent."""
    from mmferry.encoder.model import VisionEncoder
    from mmferry.server.limits import Limits
    from mmferry.server.service import EncoderService, ServiceConfig
    from mmferry.server.sglang_routes import SglangRoutes

    from .in_process import PROC, TOWER

    sock, port = pull
    limits = Limits(allow_paths=(str(media_dir),))

    async def run() -> float:
        service = EncoderService(
            PROC,
            VisionEncoder.random("qwen3-vl", config=TOWER),
            ServiceConfig(limits=limits, shm_bytes=0, preprocess_threads=1),
        )
        await service.start()
        routes = SglangRoutes(service)
        try:
            send = routes.pusher.send

            async def returns_late(link: Any, frames: Any) -> None:
                await send(link, frames)
                await asyncio.sleep(1)  # the push's thread handing back late, as under load

            routes.pusher.send = returns_late  # type: ignore[method-assign]
            call = asyncio.ensure_future(
                routes.encode(None, body([str(media_dir / "img0.png")], port))
            )
            head, _ = await asyncio.to_thread(sock.recv_multipart)
            assert load(head)["error_msg"] is None
            call.cancel()  # as SGLang does with the rows in hand
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.gather(*routes._tasks)
            sent = {"backend": "zmq_to_tokenizer", "outcome": "sent"}
            return service.metrics.registry.get_sample_value("mmferry_sglang_parts_total", sent)
        finally:
            await routes.close()
            await service.close()

    assert asyncio.run(run()) == 1


@pytest.mark.parametrize(
    "kind, cause",
    [("refused", "refused"), ("silent", "no answer"), ("mute", "no ZMQ handshake")],
)
def test_an_unreachable_receive_address_fails_the_part_within_the_connect_timeout(
    server, media_dir, kind, cause
):
    """The connection to the address `/encode` names starts as the call arrives, beside the
    encode: one that is not up within `--sglang-connect-timeout` (2 s) fails the part with a
    502 naming the address and what the connect met, not after the send's 30 s."""
    with unreachable_port(kind) as port:
        t = time.monotonic()
        r = httpx.post(
            f"{server.url}/encode", json=body([str(media_dir / "img0.png")], port), timeout=60
        )
        took = time.monotonic() - t
    assert r.status_code == 502, r.text
    assert r.json()["kind"] == "receiver_unreachable"
    message = r.json()["message"]
    assert f"127.0.0.1:{port}" in message and cause in message and "2 s" in message, message
    assert 1.9 <= took < 5, took


def test_an_unreachable_receiver_leaves_no_socket_task_or_encode_behind(media_dir):
    """In process, a short connect timeout and a slow encode: the part fails at the deadline,
    its encode is cancelled, and no task, socket or file descriptor outlives the call; a
    reachable receiver afterwards gets its rows (nothing was left half-open)."""
    from mmferry.encoder.model import VisionEncoder
    from mmferry.server.limits import Limits, RequestError
    from mmferry.server.service import EncoderService, ServiceConfig
    from mmferry.server.sglang_routes import SglangRoutes

    from .in_process import PROC, TOWER

    limits = Limits(allow_paths=(str(media_dir),))
    config = ServiceConfig(limits=limits, shm_bytes=0, preprocess_threads=1, sglang_connect_s=0.5)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def run() -> None:
        service = EncoderService(PROC, VisionEncoder.random("qwen3-vl", config=TOWER), config)
        await service.start()
        routes = SglangRoutes(service)
        try:
            rows = routes.rows
            cancelled = asyncio.Event()

            async def slow_rows(req: Any) -> Any:
                try:
                    await asyncio.sleep(30)  # an encode far longer than the deadline
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return await rows(req)

            tasks = asyncio.all_tasks()
            routes.rows = slow_rows  # type: ignore[method-assign]
            before = 0
            # The first call starts ZMQ's own threads (and their descriptors): counted after it.
            for kind in ("refused", "silent", "refused"):
                with unreachable_port(kind) as port:
                    t = time.monotonic()
                    with pytest.raises(RequestError) as err:
                        await routes.encode(None, body([str(media_dir / "img0.png")], port))
                    took = time.monotonic() - t
                assert err.value.status == 502 and err.value.kind == "receiver_unreachable"
                assert f"127.0.0.1:{port}" in err.value.message and "0.5 s" in err.value.message
                assert 0.45 <= took < 2.5, (kind, took)
                assert cancelled.is_set()
                cancelled.clear()
                if not before:
                    await asyncio.sleep(0.2)  # ZMQ's reaper thread closes a socket's descriptor
                    before = fds()
            await asyncio.sleep(0.2)
            assert not routes._tasks
            assert asyncio.all_tasks() == tasks  # the service's own, no more
            assert fds() <= before, (before, fds())
            undelivered = {"backend": "zmq_to_tokenizer", "outcome": "undelivered"}
            counted = service.metrics.registry.get_sample_value(
                "mmferry_sglang_parts_total", undelivered
            )
            assert counted == 3
            routes.rows = rows  # type: ignore[method-assign]
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PULL)
            try:
                sock.setsockopt(zmq.RCVTIMEO, 30_000)
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                got = await routes.encode(None, body([str(media_dir / "img0.png")], port))
                head, _ = await asyncio.to_thread(sock.recv_multipart)
                assert load(head)["error_msg"] is None and got["embedding_size"] > 0
            finally:
                sock.close(linger=0)
                ctx.term()
        finally:
            await routes.close()
            await service.close()

    asyncio.run(run())


def test_a_part_whose_receiver_is_unreachable_leaves_the_service_clean(media_dir):
    """The real encode path, held in the batcher's queue (`batch_wait_s` 3 s) past the connect
    deadline (0.5 s): the part fails at the deadline, long before its encode would end; the item
    still queued is encoded and cached as for any caller that hung up (nothing waits on it),
    and then no request, queued item or task of the call remains."""
    from mmferry.encoder.model import VisionEncoder
    from mmferry.server.limits import Limits, RequestError
    from mmferry.server.service import EncoderService, ServiceConfig
    from mmferry.server.sglang_routes import SglangRoutes

    from .in_process import PROC, TOWER

    config = ServiceConfig(
        limits=Limits(allow_paths=(str(media_dir),)),
        shm_bytes=0,
        preprocess_threads=1,
        batch_wait_s=3.0,
        sglang_connect_s=0.5,
    )

    async def run() -> None:
        service = EncoderService(PROC, VisionEncoder.random("qwen3-vl", config=TOWER), config)
        await service.start()
        routes = SglangRoutes(service)
        try:
            tasks = asyncio.all_tasks()
            with unreachable_port("silent") as port:
                t = time.monotonic()
                with pytest.raises(RequestError) as err:
                    await routes.encode(None, body([str(media_dir / "img1.png")], port))
                took = time.monotonic() - t
            assert err.value.kind == "receiver_unreachable" and 0.45 <= took < 2.0, took
            assert service.batcher.depth == 1  # still queued when the part failed
            deadline = time.monotonic() + 30
            while service.batcher.depth or len(service.cache) == 0:
                assert time.monotonic() < deadline, "the queued item was never encoded"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.2)
            assert not routes._tasks and asyncio.all_tasks() == tasks
        finally:
            await routes.close()
            await service.close()

    asyncio.run(run())
