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


def test_a_generic_family_checkpoint_is_one_line(tmp_path, capsys):
    """The demo runs native families only; a Gemma 3 folder says so and where it is read."""
    from mmferry.testing.families import save_family_checkpoint

    model = save_family_checkpoint("gemma3", tmp_path)
    capsys.readouterr()  # the builder's own progress output
    argv = ["demo", "--model", str(model)]
    _one_line_error(capsys, argv, "model_type 'gemma3' has no native spec", "generic family")


def test_family_generic_without_a_checkpoint_is_one_line(capsys):
    for cmd in ("demo", "serve"):
        _one_line_error(capsys, [cmd, "--family", "generic"], "--family generic needs --model")


def test_a_checkpoint_neither_family_serves_is_one_line(tmp_path, capsys):
    """A model_type transformers does not know, and a text-only checkpoint of a known one:
    `mmferry serve` names why, in one line, before it listens."""
    import json

    from mmferry.testing.families import save_family_checkpoint

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-vlm"}))
    _one_line_error(
        capsys,
        ["serve", "--model", str(unknown), "--port", "0"],
        "'no-such-vlm' is neither native to mmferry",
        "neither the native nor the generic family can serve it",
    )
    text = save_family_checkpoint("gemma3", tmp_path / "text")
    config = json.loads((text / "config.json").read_text())
    (text / "config.json").write_text(
        json.dumps({**config["text_config"], "model_type": "gemma3_text"})
    )
    capsys.readouterr()  # the builder's own progress output
    _one_line_error(
        capsys,
        ["serve", "--model", str(text), "--port", "0"],
        "gemma3_text",
        "the generic family cannot serve it",
    )


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


@pytest.mark.parametrize("cmd", ["encode", "serve", "proxy"])
def test_wrong_option_after_encode_or_serve_shows_that_command(capsys, cmd):
    argv = {
        "encode": [cmd, "x.png", "--out", "o.safetensors"],
        "proxy": [cmd, "--llm", "http://a:1", "--encoder", "http://b:2"],
    }.get(cmd, [cmd])
    with pytest.raises(SystemExit) as e:
        main([*argv, "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: mmferry {cmd}") and "--bogus" in err, err


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_one_error_line(capsys, port):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # The command's usage in one line, then what is wrong in one line.
    assert lines[0].startswith("usage: mmferry serve") and len(lines) == 2, lines
    assert lines[1].startswith("mmferry serve: error: argument --port: "), lines
    assert port in lines[1] and "Traceback" not in lines[1]


@pytest.mark.parametrize("cmd", ["demo", "bench", "encode", "serve", "proxy"])
def test_every_option_has_help_and_shows_its_default(cmd):
    from mmferry.cli import build_parser

    parser = build_parser()[1][cmd]
    for action in parser._actions:
        assert action.help, f"mmferry {cmd} {action.option_strings or action.dest} has no help"
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or action.default is argparse.SUPPRESS:
            continue  # an old spelling, kept working
        if action.option_strings and not _no_default(action.default):
            assert f"(default: {action.default})" in text, (cmd, action.dest)


def _no_default(value) -> bool:
    # NOTE: by identity: 0 and 0.0 are defaults to show (0 == False).
    return value is None or value is False or (isinstance(value, (list, tuple)) and not value)


def _parse(argv: list[str]) -> argparse.Namespace:
    from mmferry.cli import build_parser

    return build_parser()[1][argv[0]].parse_args(argv[1:])


def test_serve_limits_have_a_prefix_of_their_own_and_keep_their_old_names():
    from mmferry.server.limits import Limits

    new = _parse(["serve", "--limit-request-bytes", "5", "--limit-items", "3"])
    old = _parse(["serve", "--max-request-bytes", "5", "--max-items", "3"])
    more = ["--limit-pixels", "7", "--limit-frames", "9"]
    assert (new.limit_request_bytes, new.limit_items) == (old.limit_request_bytes, old.limit_items)
    assert (
        _parse(["serve", *more]).limit_frames,
        _parse(["serve", "--max-frames", "9"]).limit_frames,
    ) == (9, 9)
    assert _parse(["serve", *more]).limit_pixels == 7
    # --max-pixels is the resize budget now, as in transformers; the limit keeps its default.
    args = _parse(["serve", "--max-pixels", "50000"])
    assert args.max_pixels == 50000 and args.limit_pixels == Limits().max_pixels


@pytest.mark.parametrize("cmd", ["demo", "encode", "serve"])
def test_resize_options_mean_what_transformers_means(cmd):
    import mmferry as mf
    from mmferry.commands.model_args import resize_options

    head = [cmd, "x.png", "--out", "o"] if cmd == "encode" else [cmd]
    given = ["--min-pixels", "4096", "--max-pixels", "65536", "--video-min-pixels", "8192"]
    given += ["--video-max-pixels", "131072", "--fps", "1.5", "--num-frames", "8"]
    options = resize_options(_parse([*head, *given]))
    # Qwen2-VL's video processor takes min_pixels / max_pixels too (videos_kwargs wins there);
    # Qwen3-VL's only its own.
    for family in ("qwen2-vl", "qwen3-vl"):
        cfg = mf.Processor.for_model(family, **options).config
        want = mf.Processor.for_model(
            family,
            images_kwargs={"min_pixels": 4096, "max_pixels": 65536},
            videos_kwargs={"min_pixels": 8192, "max_pixels": 131072},
            fps=1.5,
            num_frames=8,
        ).config
        assert cfg == want, family
        assert (cfg.image_min_pixels, cfg.image_max_pixels) == (4096, 65536)
        assert (cfg.video_min_pixels, cfg.video_max_pixels, cfg.fps, cfg.num_frames) == (
            8192,
            131072,
            1.5,
            8,
        )
    only_image = resize_options(_parse([*head, "--max-pixels", "200704"]))
    qwen2 = mf.Processor.for_model("qwen2-vl", **only_image).config
    assert qwen2.image_max_pixels == qwen2.video_max_pixels == 200704, "as transformers has it"


def test_old_image_max_pixels_is_the_image_budget_alone():
    import mmferry as mf
    from mmferry.commands.model_args import resize_options

    options = resize_options(_parse(["serve", "--image-max-pixels", "65536"]))
    cfg = mf.Processor.for_model("qwen2-vl", **options).config
    default = mf.Processor.for_model("qwen2-vl").config
    assert cfg.image_max_pixels == 65536 and cfg.video_max_pixels == default.video_max_pixels


def test_depth_zero_is_a_mistake_not_the_full_tower(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    argv = ["encode", str(tmp_path / "a.png"), "--out", str(tmp_path / "o.st"), "--depth", "0"]
    _one_line_error(capsys, argv, "--depth must be at least 1")
    assert not (tmp_path / "o.st").exists()


def test_the_store_is_an_option_of_serve_only():
    # The proxy routes and never encodes: a --store there would be accepted and do nothing.
    from mmferry.cli import build_parser

    parsers = build_parser()[1]
    options = {cmd: {o for a in parsers[cmd]._actions for o in a.option_strings} for cmd in parsers}
    assert "--store" in options["serve"]
    assert "--store" not in options["proxy"]
