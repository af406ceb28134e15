"""A vLLM server the tests and the face-off start is stopped with every process under it, and
what those made in /dev/shm (its shared-memory broadcast segments, its semaphores) goes
with it, even when its engine core was killed and so unlinked nothing."""

from __future__ import annotations

import os
import signal

from tests.engines.conftest import needs_vllm
from tests.engines.sglang_harness import descendants, shm_names
from tests.engines.tiny_vlm import build_checkpoint
from tests.proxy.procs import VllmServer


def test_a_stopped_vllm_leaves_nothing_in_dev_shm(tmp_path):
    needs_vllm()
    model = build_checkpoint("qwen2_5_vl", tmp_path / "model")
    (tmp_path / "vllm").mkdir()
    vllm = VllmServer(model, tmp_path / "vllm").start()
    tree = descendants(vllm.proc.pid)
    try:
        made = set(vllm.shm.made)
        assert any(n.startswith("psm_") for n in made), made  # what a killed core leaves
        others = tree[1:]
        assert others, "vLLM's engine core runs in its own process"
        for pid in others:
            os.kill(pid, signal.SIGKILL)
    finally:
        vllm.stop()
    assert not [pid for pid in tree if os.path.exists(f"/proc/{pid}")]
    assert not made & shm_names(), made & shm_names()
