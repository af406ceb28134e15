"""The benchmarks' progress bar: drawn on a terminal, nothing on a pipe or a log."""

from __future__ import annotations

import io

import pytest

from mmferry.bench import harness


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so what a bar draws can be read back."""

    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO) -> str:
    with harness.progress(4, "rounds", stream=stream) as bar:
        for _ in range(4):
            bar.update(1)
    return stream.getvalue()


def test_no_bar_when_stderr_is_not_a_terminal():
    assert _run(io.StringIO()) == ""


def test_a_bar_on_a_terminal():
    pytest.importorskip("tqdm")
    assert "0/4" in _run(Terminal())


def test_interleave_draws_nothing_on_a_pipe(capsys):
    harness.interleave({"a": lambda: 0.0, "b": lambda: 0.0}, rounds=5)
    assert capsys.readouterr().err == ""
