"""The SGLang harness's /dev/shm cleanup, without SGLang: a process group made as the harness
starts an engine (a session of its own) creates what SGLang's processes leave when they are
killed, a multiprocessing semaphore under the spawn start method and a load-report file it
maps, and is killed as the harness kills an engine. What the group made is removed; what
another process made meanwhile, of the same kinds, is left alone."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys

from tests.engines.sglang_harness import SHM, ShmLeftovers, shm_names

GROUP = """\
import mmap, multiprocessing, sys, time
lock = multiprocessing.get_context("spawn").Lock()  # /dev/shm/sem.mp-*, unlinked at exit only
f = open(sys.argv[1], "w+b")
f.truncate(4096)
view = mmap.mmap(f.fileno(), 4096)
f.close()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_killed_group_leaves_nothing_it_made():
    tag = secrets.token_hex(4)
    loads = SHM / f"sglang_loads_test-{tag}_{tag}.shm"
    before = shm_names()
    proc = subprocess.Popen(
        [sys.executable, "-c", GROUP, str(loads)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # Another program's file of the same kinds, made while the group runs: not the group's.
    other = SHM / f"sglang_loads_other-{tag}_{tag}.shm"
    try:
        assert proc.stdout.readline() == "ready\n"
        other.write_bytes(b"")
        leftovers = ShmLeftovers(proc.pid, before)
        leftovers.note()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ours = leftovers.made
        assert loads.name in ours and any(n.startswith("sem.mp-") for n in ours), ours
        assert other.name not in ours
        # Killed, the group unlinked nothing itself: what the harness has to remove.
        assert ours <= shm_names()
        assert sorted(leftovers.remove()) == sorted(ours)
        assert not ours & shm_names()
        assert other.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for path in (loads, other):
            path.unlink(missing_ok=True)
