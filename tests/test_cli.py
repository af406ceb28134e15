from __future__ import annotations

import os
import re

import pytest

from mmferry.cli import main
from mmferry.transport.segment import PREFIX


def test_demo_runs_the_whole_path(capsys):
    assert main(["demo", "--max-pixels", str(64 * 32 * 32)]) == 0
    out = capsys.readouterr().out
    for stage in ("preprocess", "prompt", "transport", "encode", "merge"):
        assert f"\n{stage} " in "\n" + out, out
    assert "RANDOM weights" in out
    # Every image's tokens, and nothing else, land in the prompt (the video needs a tokenizer).
    image_tokens = [
        int(line.split("tokens")[0].split()[-1])
        for line in out.splitlines()
        if line.startswith("  image ")
    ]
    assert len(image_tokens) == 3
    assert f"merge       {sum(image_tokens)} of " in out
    # Only this process's segments: other processes (servers, parallel runs) may hold theirs.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{PREFIX}{os.getpid()}-")]


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_help_names_only_real_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    described = re.search(r"`mmferry ([^`]*)`", out).group(1).split(" | ")
    for cmd in described:  # every command the description promises parses
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0, cmd
