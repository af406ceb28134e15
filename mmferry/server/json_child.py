"""Large JSON bodies parsed in a child process, so that parsing never blocks the event loop.

`json.loads` holds the GIL for the whole parse: a 32 MiB body took 0.2-0.3 s (one data URL)
to 2.7-4.5 s (ten million empty objects) on the event loop, and a thread does not help. A body
over `INLINE_BYTES` is parsed by one child (plain Python, no mmferry import: `python -I -S`),
which first bounds the number of values from a count of `,`, `[` and `{` (the one cost that
grows with the count is then bounded too), and sends the value back pickled: the loop then
spends only the unpickling (bytes copied, at most `MAX_JSON_VALUES` objects built). Smaller
bodies are parsed in place, under the same bound, and so are bodies up to `FEW_VALUES_BYTES`
of few values (a few images as data: URLs: json copies long strings at about 2.3 ms a MB here,
where the round trip through the child cost 0.7 ms for a 160 KB body against 0.24 in place).
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import sys
from typing import Any

from mmferry.server.bodies import MAX_JSON_VALUES, json_error, json_values, parse_json
from mmferry.server.limits import RequestError

INLINE_BYTES = 64 << 10  # at most about 20,000 values: a few milliseconds in place
FEW_VALUES_BYTES = 256 << 10  # at most FEW_VALUES values: well under a millisecond in place
FEW_VALUES = 2_000
PIECE = 1 << 20

# The child: frames of <8-byte length><body> in; <1-byte kind><8-byte length><data> out, where
# kind 0 is a pickled value, 1 too many values, 2 nested too deeply, 3 invalid (data: why).
_CHILD = r"""
import json, pickle, sys, types
# NaN and the infinities unpickle as mmferry.server.bodies.NotFinite, as parse_json reads them.
for name in ("mmferry", "mmferry.server", "mmferry.server.bodies"):
    bodies = sys.modules[name] = types.ModuleType(name)
class NotFinite(float):
    pass
NotFinite.__module__ = bodies.__name__
bodies.NotFinite = NotFinite
limit = int(sys.argv[1])
r, w = sys.stdin.buffer, sys.stdout.buffer
def reply(kind, data):
    w.write(bytes([kind]) + len(data).to_bytes(8, "little") + data)
    w.flush()
while True:
    head = r.read(8)
    if len(head) < 8:
        break
    raw = r.read(int.from_bytes(head, "little"))
    count = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if count > limit:
        reply(1, str(count).encode())
        continue
    try:
        reply(0, pickle.dumps(json.loads(raw, parse_constant=NotFinite), protocol=5))
    except RecursionError:
        reply(2, b"")
    except ValueError as e:
        reply(3, str(e)[:200].encode())
"""


class JsonChild:
    """One child process parsing bodies in turn; restarted if it dies."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def parse(self, raw: bytes | bytearray) -> Any:
        """`raw` parsed, as `parse_json` would; the event loop stays free meanwhile."""
        if len(raw) <= INLINE_BYTES:
            return parse_json(raw)
        if len(raw) <= FEW_VALUES_BYTES:
            values = json_values(raw)  # counted once, for this choice and parse_json's bound
            if values <= FEW_VALUES:
                return parse_json(raw, values)
        # NOTE: shielded: a request cancelled mid-exchange must not leave half a frame on the
        # pipe for the next one.
        kind, data = await asyncio.shield(asyncio.ensure_future(self._exchange(raw)))
        if kind == 0:
            return pickle.loads(data)
        raise json_error(kind, data.decode())

    async def _exchange(self, raw: bytes | bytearray) -> tuple[int, bytearray]:
        async with self._lock:
            proc = await self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                # NOTE: in pieces both ways, so that no single copy of a 32 MiB body (into the
                # pipe's buffer, out of the reader's) holds the loop.
                view = memoryview(raw)
                proc.stdin.write(len(raw).to_bytes(8, "little"))
                for at in range(0, len(raw), PIECE):
                    proc.stdin.write(view[at : at + PIECE])
                    await proc.stdin.drain()
                head = await proc.stdout.readexactly(9)
                out = bytearray(int.from_bytes(head[1:], "little"))
                at = 0
                while at < len(out):
                    piece = await proc.stdout.read(min(PIECE, len(out) - at))
                    if not piece:
                        raise asyncio.IncompleteReadError(bytes(out[:at]), len(out))
                    out[at : at + len(piece)] = piece
                    at += len(piece)
                return head[0], out
            except (OSError, asyncio.IncompleteReadError):
                # It died (out of memory, killed): the next body gets a new one.
                self._proc = None
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise RequestError(500, "internal", "the JSON parsing process died") from None

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                _CHILD,
                str(MAX_JSON_VALUES),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        return self._proc

    async def close(self) -> None:
        """End the child (it also ends by itself when this process's end of the pipe closes)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
