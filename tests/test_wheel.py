"""The package works installed from a wheel: `mmferry bench` finds its benchmarks and the
test builders they import, with no source checkout on the path."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_wheel_runs_bench_prompt(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=600,
    )
    wheel = next(dist.glob("mmferry-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # The dependencies (torch, transformers, ...) come from this environment's site-packages,
    # added as a plain path: its .pth files (among them an editable install's finder) are not
    # run, so `mmferry` can only come from the wheel.
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    Path(purelib, "deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [py, "-c", "import mmferry; print(mmferry.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
    ).stdout
    assert where.startswith(purelib), where
    run = subprocess.run(
        [venv / "bin" / "mmferry", "bench", "prompt", "--quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "get_rope_index" in run.stdout, run.stdout[-3000:]
