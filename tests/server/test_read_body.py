"""`read_body` in the request's own task: its deadline (408), the drain's cut (503) and a
cancel from elsewhere (a client gone, the server stopping) told apart, and nothing left
registered or cancelled behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mmferry.server.bodies import ReadCut, read_body
from mmferry.server.limits import RequestError


class Upload:
    """A request whose body arrives in `chunks`, then never ends unless `whole`."""

    def __init__(self, chunks: list[bytes], whole: bool = False) -> None:
        self.headers: dict[str, str] = {}
        self.chunks = chunks
        self.whole = whole

    async def stream(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            await asyncio.sleep(0)
            yield c
        if not self.whole:
            await asyncio.Event().wait()


def test_a_whole_body_is_read():
    async def main() -> None:
        cut = ReadCut()
        body = await read_body(Upload([b"ab", b"cd"], whole=True), 10, 5, cut)
        assert body == b"abcd" and type(body) is bytes
        assert not cut._readers

    asyncio.run(main())


def test_a_body_past_its_deadline_is_408():
    async def main() -> None:
        cut = ReadCut()
        with pytest.raises(RequestError) as e:
            await read_body(Upload([b"ab"]), 10, 0.1, cut)
        assert (e.value.status, e.value.kind) == (408, "body_timeout")
        assert not cut._readers

    asyncio.run(main())


def test_the_cut_ends_every_body_still_arriving_with_503_and_later_ones_at_once():
    async def main() -> None:
        cut = ReadCut()
        reads = [asyncio.ensure_future(read_body(Upload([b"x"]), 10, 30, cut)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert len(cut._readers) == 3
        cut.set()
        for r in reads:
            with pytest.raises(RequestError) as e:
                await r
            assert (e.value.status, e.value.kind) == (503, "draining")
            assert r.cancelling() == 0  # the cut's cancel undone
        with pytest.raises(RequestError) as e:
            await read_body(Upload([b"x"], whole=True), 10, 30, cut)
        assert e.value.status == 503
        assert not cut._readers and not cut._cut

    asyncio.run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel_with_or_without_the_cut():
    async def main() -> None:
        cut = ReadCut()
        alone = asyncio.ensure_future(read_body(Upload([b"x"]), 10, 30, cut))
        both = asyncio.ensure_future(read_body(Upload([b"x"]), 10, 30, cut))
        await asyncio.sleep(0.05)
        alone.cancel()
        both.cancel()
        cut.set()  # in the same turn: the task is cancelled twice
        for r in (alone, both):
            with pytest.raises(asyncio.CancelledError):
                await r
        assert not cut._readers and not cut._cut

    asyncio.run(main())


def test_a_body_over_its_limit_is_413_in_the_read():
    async def main() -> None:
        cut = ReadCut()
        with pytest.raises(RequestError) as e:
            await read_body(Upload([b"abc", b"def"], whole=True), 4, 5, cut)
        assert e.value.status == 413
        assert not cut._readers

    asyncio.run(main())
