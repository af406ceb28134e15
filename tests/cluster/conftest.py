"""The cluster tests build hosts as network namespaces (`mmferry.testing.cluster`); they need
root and the kernel's namespaces, and skip only where those are missing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mmferry.testing import cluster


@pytest.fixture(scope="session")
def netns() -> None:
    why = cluster.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def make_net(netns, tmp_path_factory) -> Iterator[Callable[[list[str]], cluster.Net]]:
    """Build a run's hosts; at the module's end every one is stopped, and nothing of it may
    remain (asserted)."""
    nets: list[cluster.Net] = []

    def make(hosts: list[str]) -> cluster.Net:
        work: Path = tmp_path_factory.mktemp("net")
        net = cluster.Net(hosts, work)
        nets.append(net)
        return net.start()

    yield make
    for net in nets:
        net.stop()
    left = [x for net in nets for x in net.leftovers()]
    assert not left, f"left after the run: {left}"
