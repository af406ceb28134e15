"""mmferry/bench/gpu_checks.sh: its steps fit 8 minutes, and a failing step fails the script."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "mmferry" / "bench" / "gpu_checks.sh"


def _run(tmp_path, *args, path_dirs=()):
    env = {**os.environ, "OUT": str(tmp_path)}
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), env["PATH"]])
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_dry_run_lists_every_step_within_eight_minutes(tmp_path):
    r = _run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    limits = [int(s) for s in re.findall(r"\(limit (\d+)s\)", r.stdout)]
    assert sum(limits) < 8 * 60
    for needed in ("cuda-tests", "bench-encoder-full", "--full", "proxy-cpu", "test_graphs.py"):
        assert needed in r.stdout
    assert "nothing ran" in r.stdout
    assert (tmp_path / "gpu_checks.log").read_text() == r.stdout


def _fake(tmp_path, name: str, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return bin_dir


def test_a_failing_step_is_named_and_fails_the_script(tmp_path):
    bin_dir = _fake(tmp_path, "nvidia-smi", "echo no device >&2; exit 9")
    r = _run(tmp_path, "--only", "device", path_dirs=[bin_dir])
    assert r.returncode == 1
    assert "!! device FAILED (exit 9)" in r.stdout
    assert "1 step(s) FAILED" in r.stdout


def test_a_passing_step_passes(tmp_path):
    bin_dir = _fake(tmp_path, "nvidia-smi", "echo GPU 0: a device")
    r = _run(tmp_path, "--only", "device", path_dirs=[bin_dir])
    assert r.returncode == 0, r.stdout
    assert "GPU 0: a device" in r.stdout and "every step passed" in r.stdout


def test_bad_arguments_and_unknown_steps_fail(tmp_path):
    assert _run(tmp_path, "--bogus").returncode == 2
    assert _run(tmp_path, "--only").returncode == 2
    r = _run(tmp_path, "--only", "no-such-step")
    assert r.returncode == 1 and "no step ran" in r.stdout
