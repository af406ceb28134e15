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
