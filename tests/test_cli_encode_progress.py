"""`mmferry encode`'s progress bar: tqdm's on a terminal, nothing on a pipe or a log, and the
command's own lines the same either way."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import tqdm  # noqa: F401 - a dependency: missing, the tests fail rather than skip
from PIL import Image

from mmferry.commands import encode


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so what a bar draws can be read back."""

    def isatty(self) -> bool:
        return True


def _drive(stream: io.StringIO) -> str:
    bar = encode.Progress(3, stream=stream)
    for _ in range(3):
        bar.update(1, 64)
    bar.close()
    return stream.getvalue()


def test_no_bar_when_stderr_is_not_a_terminal():
    assert _drive(io.StringIO()) == ""


def test_tqdms_bar_on_a_terminal():
    drawn = _drive(Terminal())
    assert "100%|" in drawn and "3/3" in drawn and "tokens/s" in drawn


def _lines(folder: Path, stream: io.StringIO, monkeypatch) -> list[str]:
    """The stderr lines of one encode of two PNGs with stderr being `stream`: each line as
    last drawn (after its carriage returns), the folder and the elapsed seconds masked."""
    folder.mkdir()
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    monkeypatch.setattr(sys, "stderr", stream)
    from mmferry.cli import main

    out = folder / "o.safetensors"
    assert main(["encode", str(folder / "*.png"), "--out", str(out), "--depth", "1"]) == 0
    lines = [line.rsplit("\r", 1)[-1] for line in stream.getvalue().splitlines()]
    return [line.replace(str(folder), "DIR").split(" in ")[0] for line in lines]


def test_the_commands_lines_are_the_same_on_a_pipe_and_a_terminal(tmp_path, monkeypatch, capsys):
    piped = _lines(tmp_path / "piped", io.StringIO(), monkeypatch)
    assert piped[0].startswith("mmferry encode: 2 inputs with")
    assert piped[1].startswith("mmferry encode: wrote 2 items (") and len(piped) == 2
    shown = _lines(tmp_path / "shown", Terminal(), monkeypatch)
    bar = [line for line in shown if "/2 [" in line]  # tqdm's frames: "| 2/2 [00:01<...]"
    assert any("100%" in line for line in bar)
    assert [line for line in shown if line not in bar and line.strip()] == piped
    assert capsys.readouterr().out == ""
