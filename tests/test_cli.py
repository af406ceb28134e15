from __future__ import annotations

import argparse
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


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_folder_without_config_is_one_line(tmp_path, capsys):
    _one_line_error(capsys, ["demo", "--model", str(tmp_path)], "config.json", str(tmp_path))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys):
    _one_line_error(capsys, ["demo", "--device", "cuda"], "--device cuda", "torch")
    _one_line_error(capsys, ["demo", "--device", "tpu:x"], "not a device")


def test_wrong_option_after_a_command_shows_that_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mmferry demo") and "--bogus" in err, err


@pytest.mark.parametrize("cmd", ["demo", "bench"])
def test_every_option_has_help_and_shows_its_default(cmd):
    from mmferry.cli import build_parser

    parser = build_parser()[1][cmd]
    for action in parser._actions:
        assert action.help, f"mmferry {cmd} {action.option_strings or action.dest} has no help"
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, [], ()):
            if action.default is argparse.SUPPRESS:
                continue
            assert f"(default: {action.default})" in " ".join(text.split()), action.dest
