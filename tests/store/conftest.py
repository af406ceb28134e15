"""The store tests run a real Mooncake master and holder on loopback (`make mooncake-venv`
installs them; without it the tests fail saying so)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.store import cluster


@pytest.fixture(scope="session")
def mooncake() -> None:
    if not cluster.installed():
        pytest.fail(f"Mooncake is missing ({cluster.MOONCAKE}); run `make mooncake-venv`")
    cluster.import_here()


@pytest.fixture(scope="module")
def store_cluster(mooncake, tmp_path_factory) -> Iterator[cluster.Cluster]:
    c = cluster.Cluster(tmp_path_factory.mktemp("mooncake"))
    try:
        yield c.start()
    finally:
        c.stop()
