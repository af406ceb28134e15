"""`mmferry encode` through subprocesses: bad inputs skipped and named, interrupts leave nothing."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.commands.model_args import shallow
from mmferry.models import spec_for
from mmferry.server.encoded import load_file

ROOT = Path(__file__).resolve().parents[1]
MAX_PIXELS = 65536


def _png(path: Path, w: int, h: int, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def _encode(args: list[str], cwd: Path, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mmferry", "encode", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def test_folder_with_one_corrupt_image(tmp_path):
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    _png(media / "a.png", 64, 64, 0)
    _png(media / "sub" / "b.png", 96, 48, 1)
    buf = io.BytesIO()
    Image.new("RGB", (70, 50), (10, 200, 30)).save(buf, format="JPEG")
    (media / "c.jpg").write_bytes(buf.getvalue())
    (media / "broken.jpg").write_bytes(buf.getvalue()[:100])
    (media / "notes.txt").write_text("not media; folders skip unknown suffixes")
    out = tmp_path / "out" / "emb.safetensors"
    args = [str(media), "--out", str(out), "--depth", "1", "--image-max-pixels", str(MAX_PIXELS)]
    p = _encode(args, tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 1, stderr  # some failed, the rest written
    assert "FAILED" in stderr and "broken.jpg" in stderr and "1 failed" in stderr
    items = load_file(out)
    assert [Path(i.source).name for i in items] == ["a.png", "c.jpg", "b.png"]
    assert not [f for f in out.parent.iterdir() if f.name != out.name]  # no temporary left

    proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=MAX_PIXELS)
    enc = mf.VisionEncoder.random(config=shallow(spec_for("qwen3-vl").random_config, 1))
    want = [proc.image(i.source, "compact-u8") for i in items]
    with torch.inference_mode():
        outs = enc(want)
    for got, it, o in zip(items, want, outs):
        assert (got.hash, got.grid_thw, got.num_tokens) == (it.hash, it.grid_thw, it.num_tokens)
        torch.testing.assert_close(got.embeds, o.embeds, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.deepstack[0], o.deepstack[0], atol=1e-5, rtol=1e-5)


def test_nothing_to_encode_writes_nothing(tmp_path):
    out = tmp_path / "o.safetensors"
    (tmp_path / "bad.png").write_bytes(b"not an image")
    p = _encode(
        [str(tmp_path / "bad.png"), "missing.png", "--out", str(out), "--depth", "1"], tmp_path
    )
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 2 and "nothing written" in stderr
    assert "missing.png: no such file" in stderr and "bad.png" in stderr
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_leaves_no_output(tmp_path, sig):
    for i in range(40):
        _png(tmp_path / f"{i:02d}.png", 256, 256, i)
    out = tmp_path / "out.safetensors"
    # The full-depth default tower: slow enough that the signal lands mid-run.
    p = _encode([str(tmp_path / "*.png"), "--out", str(out)], tmp_path)
    line = p.stderr.readline()
    assert "40 inputs" in line, line + p.stderr.read()
    p.send_signal(sig)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not out.exists()
    assert not [f for f in tmp_path.iterdir() if f.suffix == ".tmp"]
