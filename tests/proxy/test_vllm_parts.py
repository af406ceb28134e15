"""Every content part vLLM 0.32's own chat parser reads as media, over a corpus of parts of every
type and key combination (tests/proxy/vllm_reads.py), is one the proxy's parser takes as media
(checked and rewritten) or refuses; and the tests' written-out reading of vLLM's parser agrees
with vLLM's on each part it reads as media. vLLM's parser runs in vLLM's own environment."""

from __future__ import annotations

import json
import subprocess

import pytest

from mmferry.proxy.media import part_kind
from mmferry.server.limits import RequestError
from tests.engines.conftest import needs_vllm
from tests.engines.vllm_harness import VLLM_PYTHON, vllm_env
from tests.proxy.vllm_reads import MEDIA_TYPES, corpus, reads

# Reads parts (JSON lines) and writes what vLLM's parser makes of each: its part type, or the
# exception it raises.
ORACLE = """
import json, sys
from vllm.renderers.chat_utils import _parse_chat_message_content_mm_part
out = []
for line in sys.stdin:
    try:
        out.append(["read", _parse_chat_message_content_mm_part(json.loads(line))[0]])
    except Exception as e:
        out.append(["error", type(e).__name__])
print("ORACLE " + json.dumps(out))
"""


def vllm_readings(parts: list[dict]) -> list[tuple[str, str]]:
    needs_vllm()
    stdin = "".join(json.dumps(p) + "\n" for p in parts)
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", ORACLE],
        input=stdin,
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=600,
        check=False,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("ORACLE ")), None)
    assert line is not None, done.stderr[-4000:]
    return [tuple(r) for r in json.loads(line[len("ORACLE ") :])]


@pytest.fixture(scope="module")
def readings() -> list[tuple[dict, tuple[str, str]]]:
    parts = corpus()
    return list(zip(parts, vllm_readings(parts), strict=True))


def test_the_corpus_holds_every_media_type_vllm_reads(readings):
    seen = {kind for _, (status, kind) in readings if status == "read"}
    assert seen >= MEDIA_TYPES


def test_every_part_vllm_reads_as_media_is_the_proxys(readings):
    missed = []
    for part, (status, kind) in readings:
        if status != "read" or kind not in MEDIA_TYPES:
            continue
        try:
            if part_kind(part, 0, 0) is None:
                missed.append((part, kind))
        except RequestError:
            pass  # refused: the engine never gets it
    assert missed == []


def test_the_written_out_reading_agrees_with_vllms(readings):
    for part, (status, kind) in readings:
        if status == "read" and kind in MEDIA_TYPES:
            assert reads(part) == kind, part
        elif status == "read":
            assert reads(part) is None, part
