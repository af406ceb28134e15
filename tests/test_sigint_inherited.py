"""The suite runs with SIGINT as Python sets it, however it was started.

A background job of a non-interactive shell (`make test &` in a script or a CI step) starts with
SIGINT ignored, and Python keeps an inherited SIG_IGN instead of installing its own handler, in
the pytest process and in every process a test starts from it. The tests that send SIGINT (to
`mmferry encode`, to a write in progress) then see it dropped. tests/conftest.py puts Python's
handler back when the session starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ignored(signum: int) -> bool:
    with open("/proc/self/status") as f:
        mask = int(next(x for x in f if x.startswith("SigIgn:")).split()[1], 16)
    return bool(mask >> (signum - 1) & 1)


def test_sigint_is_pythons_own_in_this_process():
    assert not _ignored(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_suite_started_as_a_background_job_still_takes_sigint():
    inner = f"{Path(__file__).name}::test_sigint_is_pythons_own_in_this_process"
    pytest = f"{sys.executable} -m pytest -q -p no:cacheprovider tests/{inner}"
    # NOTE: without job control, sh starts a background job with SIGINT and SIGQUIT ignored.
    out = subprocess.run(
        ["sh", "-c", f"{pytest} & wait $!"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
