"""A list of frames is decoded and resized one frame at a time: the peak memory of building it
is about one full-size frame, however many frames the list holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMES, SIDE = 32, 2000
# In a fresh process, so the peak RSS is this item's alone: the growth from just before the
# build to the process's peak.
SCRIPT = f"""
import base64, io, json
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

buf = io.BytesIO()
Image.fromarray(np.full(({SIDE}, {SIDE}, 3), 90, np.uint8)).save(buf, "PNG")  # about 16 KB
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
# A small final size, so that what the item keeps is negligible beside the decoded frames.
part = parse_content(
    [{{"type": "video", "video": [url] * {FRAMES}, "resized_height": 64, "resized_width": 64}}]
)[0]
proc = mf.Processor.for_model("qwen3-vl")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) set back to the RSS now
before = status("VmRSS")
item = build_item(proc, part, "compact-u8", {{}})
peak = status("VmHWM")
print(json.dumps({{"growth": peak - before, "grid": item.grid_thw}}))
"""


def test_a_frame_list_holds_about_one_full_size_frame():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grid"] == [FRAMES // 2, 4, 4]
    frame = SIDE * SIDE * 3
    # Decoding all 32 first grew it by about 32 frames (a 2000x2000 frame is 11.4 MiB as RGB);
    # one at a time, by the frame being decoded and the copies its decode makes.
    assert result["growth"] < 6 * frame, f"grew {result['growth'] / 2**20:.0f} MiB"
