"""`parse_json` reads a body as the standard library's `json.loads` does (NaN and the
infinities as `NotFinite`), whichever parser did the work: orjson for bodies of few values, json
where orjson would refuse or change a value. The oracle is json itself."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmferry.server import bodies
from mmferry.server.bodies import FAST_VALUES, NotFinite, parse_json
from mmferry.server.limits import RequestError


def oracle(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", json.loads(raw, parse_constant=NotFinite)
    except (ValueError, RecursionError):
        return "error", None


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 is not 1.0, nan is nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


def check(raw: bytes) -> None:
    kind, want = oracle(raw)
    if kind == "error":
        with pytest.raises(RequestError):
            parse_json(raw)
    else:
        assert same(parse_json(raw), want), raw[:200]


# The values where orjson and json part: each must read as json reads it.
EDGES = [
    b'{"a": 123456789012345678901234567890}',  # orjson: a float
    b'{"a": -9223372036854775809}',  # just past int64: orjson, a float
    b'{"a": 18446744073709551615}',  # uint64's top: both an int
    b'{"a": 1e400}',  # json: inf; orjson refuses
    b'{"a": NaN, "b": -Infinity}',
    b'"\\ud800"',  # a lone surrogate
    b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
    b"[" * 3000 + b"]" * 3000,  # deeper than either parser goes
    b'{"a": 1e19, "b": -0.0, "c": 0.1, "d": 1E2}',
    b'{"a": 1, "a": 2}',
    b'"a\x01b"',  # a raw control character
    b'"\xff"',  # not UTF-8
    b"[1,]",
    b'{"a": "\\u0000"}',
    b"  [1, 2]\n",
    b"",
]


@pytest.mark.parametrize("raw", EDGES)
def test_where_orjson_and_json_part(raw):
    check(raw)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 80), max_value=1 << 80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_value_reads_as_json_reads_it(value):
    check(json.dumps(value).encode())


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=0), st.binary(min_size=1, max_size=3))
def test_a_spoiled_body_reads_or_fails_as_with_json(value, at, junk):
    raw = json.dumps(value).encode()
    at %= len(raw) + 1
    check(raw[:at] + junk + raw[at:])


def test_a_body_of_many_values_is_parsed_as_before():
    raw = json.dumps({"v": [1 << 70, 0.5] * FAST_VALUES}).encode()
    check(raw)


@pytest.mark.parametrize("size", [0, 1, (16 << 10) - 1, 16 << 10, (16 << 10) + 1, 200_003])
def test_the_value_bound_counts_every_comma_bracket_and_brace(size):
    # Below and past the size from which the count is vectorised, bytes and bytearray alike,
    # against a count one byte at a time.
    import random

    rng = random.Random(size)
    raw = bytes(rng.choice(b',[{}]":ab') for _ in range(size))
    plain = sum(byte in b",[{" for byte in raw)
    assert bodies.json_values(raw) == plain
    assert bodies.json_values(bytearray(raw)) == plain
