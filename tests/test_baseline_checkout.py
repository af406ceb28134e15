"""A benchmark's baseline runs the other checkout's code: its processes are started from this
checkout's directory, where `python -m mmferry` would otherwise import this one's."""

from __future__ import annotations

import sys
from pathlib import Path

from mmferry.bench import load
from tests.proxy.procs import Proc

ROOT = Path(__file__).resolve().parents[1]


def other_checkout(tmp_path: Path) -> Path:
    """A checkout whose `mmferry` says where it was imported from as its listening URL."""
    package = tmp_path / "other" / "mmferry"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import pathlib\nprint('x listening on', pathlib.Path(__file__).parent, flush=True)\n"
    )
    return package.parent


def test_a_baseline_process_imports_its_own_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the benchmarks are run from
    other = other_checkout(tmp_path)
    proc = Proc(["proxy"], root=other).start()
    proc.stop()
    assert proc.url == str(other / "mmferry")


def test_a_baseline_server_of_the_load_bench_imports_its_own_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    other = other_checkout(tmp_path)
    server, url = load.start([sys.executable, "-m", "mmferry", "serve"], root=other)
    server.wait(10)
    assert url == str(other / "mmferry")
