"""`mmferry serve --store`: a bad address and a missing extra are one line and status 2, before
any model is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.store import cluster


def serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmferry", "serve", "--port", "0", "--depth", "1", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.mark.parametrize(
    "address, why",
    [
        ("redis://127.0.0.1:1", "mooncake://MASTER_HOST:PORT"),
        ("mooncake://127.0.0.1:1", "metadata"),
        ("mooncake://127.0.0.1:1?metadata=x&ttl=9", "unknown store parameter"),
    ],
)
def test_bad_address_is_refused_before_the_model_loads(mooncake, address, why):
    r = serve(["--store", address], cluster.env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert why in r.stderr and "Traceback" not in r.stderr
    assert "VisionEncoder" not in r.stdout  # refused before the tower was built


def test_missing_extra_names_it():
    root = str(cluster.ROOT)
    r = serve(["--store", "mooncake://127.0.0.1:1?metadata=http://x/m"], {"PYTHONPATH": root})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'mmferry[mooncake]'" in r.stderr and "Traceback" not in r.stderr
