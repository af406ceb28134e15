"""How the proxy reads the first events of vLLM's stream: an error before any output means the
request failed before it ran (sent again with pixels); anything generated means it did not."""

from __future__ import annotations

import json

import pytest

from mmferry.proxy.forward import event_verdict


def event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode()


def chunk(**delta: object) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


@pytest.mark.parametrize(
    ("raw", "verdict"),
    [
        (event({"error": {"message": "Internal server error", "code": 500}}), True),
        (event(chunk(role="assistant")), None),  # the preamble: look further
        (event(chunk(role="assistant", content="")), None),
        (event(chunk(content="Hello")), False),
        # A token that decodes to nothing (half of a character) is output all the same.
        (event(chunk(content="")), False),
        (event(chunk()), False),
        (event(chunk(reasoning_content="hm")), False),
        (event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), False),
        (event({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]}), False),
        (b"data: [DONE]", False),
        (b"data: not json", False),
        (b": a comment line", None),
        (event([1, 2]), False),
    ],
)
def test_firstevent_verdicts(raw: bytes, verdict: bool | None) -> None:
    assert event_verdict(raw) is verdict


def test_a_stream_read_whole_while_looking_for_its_first_output_is_relayed_whole():
    # The engine's whole stream arrives in two writes, and the look for its first output (the
    # verdict) reads both: relayed as one answer with its length, every byte of both.
    import asyncio

    from mmferry.proxy.forward import Answer, relay
    from mmferry.proxy.http import Client
    from mmferry.server.streamed import Streamed

    preamble = event(chunk(role="assistant", content="")) + b"\n\n"
    rest = event(chunk(content="Hi")) + b"\n\ndata: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"content-length: %d\r\n\r\n" % (len(preamble) + len(rest))

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + preamble)
        await writer.drain()
        await asyncio.sleep(0.2)  # a second arrival: the verdict reads a second chunk
        writer.write(rest)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    async def main() -> list[dict]:
        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = Client(connect_timeout_s=5, read_timeout_s=5)
        try:
            answer = Answer(await client.send("POST", f"http://127.0.0.1:{port}/", body=b"{}"))
            assert await answer.failed_before_output() is False
            assert len(answer.head) == 2

            async def done() -> None:
                await answer.aclose()

            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)

            async def receive() -> dict:
                await asyncio.sleep(10)
                return {"type": "http.disconnect"}

            answered = Streamed(
                200,
                {},
                relay(answer, 0.0, lambda s: None, done),
                answer.whole,
                done,
                answer.arrived,
            )
            await answered({"type": "http", "method": "POST"}, receive, send)
            return sent
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    sent = asyncio.run(main())
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert body == preamble + rest
    start = sent[0]
    assert (b"content-length", str(len(body)).encode()) in start["headers"]
