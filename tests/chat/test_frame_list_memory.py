"""A list of frames is decoded and resized one frame at a time, and handed to the video stage
without copies: the peak memory of building it is the item's own bytes plus about one
full-size frame, however many frames the list holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIDE = 2000
FRAME = SIDE * SIDE * 3  # one full-size RGB frame: 11.4 MiB
# In a fresh process, so the peak RSS is this item's alone: the growth from just before the
# build to the process's peak.
SCRIPT = """
import base64, io, json, sys
import numpy as np
from PIL import Image
import mmferry as mf
from mmferry.chat.media import build_item
from mmferry.chat.parts import parse_content

def status(field):
    # NOTE: VmHWM, not ru_maxrss: the latter keeps the peak of the process before its exec
    # (the forked copy of a large parent).
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

frames, keys, side = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
buf = io.BytesIO()
Image.fromarray(np.full((side, side, 3), 90, np.uint8)).save(buf, "PNG")  # about 16 KB
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
part = parse_content([{"type": "video", "video": [url] * frames, **keys}])[0]
proc = mf.Processor.for_model("qwen3-vl")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) set back to the RSS now
before = status("VmRSS")
item = build_item(proc, part, "compact-u8", {})
print(json.dumps({
    "growth": status("VmHWM") - before, "grid": item.grid_thw, "item": item.feature.nbytes
}))
"""


def _build(frames: int, keys: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(frames), json.dumps(keys), str(SIDE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_frame_list_holds_about_one_full_size_frame():
    # A small final size, so that what the item keeps is negligible beside the frames.
    result = _build(32, {"resized_height": 64, "resized_width": 64})
    assert result["grid"] == [16, 4, 4]
    # Decoding all 32 first grew it by about 32 frames (406 MiB); one at a time, by the frame
    # being decoded and the copies its decode makes (about 37 MB).
    assert result["growth"] < 6 * FRAME, f"grew {result['growth'] / 2**20:.0f} MiB"


def test_a_frame_list_reaches_the_video_stage_without_copies():
    # The processor's own sizes: 48 frames of 864x864, 103 MiB of rows.
    result = _build(48, {})
    assert result["grid"] == [24, 54, 54]
    # The resized frames and the rows (the item's bytes each), and about one frame decoding
    # (261 MiB); a gathered copy of the frames and a contiguous copy to hash them took two
    # more (460 MiB).
    bound = 2 * result["item"] + 8 * FRAME
    assert result["growth"] < bound, f"grew {result['growth'] / 2**20:.0f} MiB"
