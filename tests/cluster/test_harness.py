"""The cluster harness itself: hosts reach each other only over their links, a cut link drops
packets (a connect hangs until its timeout instead of being refused), a host refusing another's
connections does so one way, tbf holds a link to its rate, the links count their bytes, and
nothing of a run outlives it."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from mmferry.testing import cluster

SINK = Path(__file__).with_name("sink.py")
PORT = 7100
SEND = """
import socket, sys, time
addr, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t = time.monotonic()
try:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        got = s.recv(64).decode()
    print("ok", got, time.monotonic() - t)
except OSError as e:
    print("error", type(e).__name__, time.monotonic() - t)
"""


@pytest.fixture(scope="module")
def net(make_net) -> cluster.Net:
    net = make_net(["a", "b"])
    a = net["a"]
    sink = a.popen([sys.executable, str(SINK), a.addr, str(PORT)], log=net.work / "sink.log")
    for _ in range(100):
        if "listening" in (net.work / "sink.log").read_text():
            break
        assert sink.poll() is None, (net.work / "sink.log").read_text()
        time.sleep(0.05)
    return net


def send(net: cluster.Net, frm: str, to: str, n: int, timeout: float = 5.0) -> list[str]:
    out = net[frm].run(
        [sys.executable, "-c", SEND, to, str(PORT), str(n), str(timeout)], timeout=timeout + 60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_hosts_talk_only_over_their_links(net):
    a = net["a"]
    before = a.counters()
    assert send(net, "b", a.addr, 1_000_000)[:2] == ["ok", "1000000"]
    received = a.counters()[0] - before[0]
    assert 1_000_000 <= received < 1_200_000  # the payload and the TCP/IP headers
    # The sink listens on a's address only: b's loopback is another stack, and from a itself
    # nothing listens on 127.0.0.1.
    assert send(net, "b", "127.0.0.1", 10)[:2] == ["error", "ConnectionRefusedError"]
    assert send(net, "a", "127.0.0.1", 10)[:2] == ["error", "ConnectionRefusedError"]


def test_a_cut_link_drops_packets_and_comes_back(net):
    a = net["a"]
    a.down()
    try:
        status, kind, took = send(net, "b", a.addr, 10, timeout=1.5)
        # A vanished peer: no refusal, the connect waits for its own timeout.
        assert (status, kind) == ("error", "TimeoutError")
        assert float(took) >= 1.4
    finally:
        a.up()
    deadline = time.monotonic() + 10
    while send(net, "b", a.addr, 10)[0] != "ok":
        assert time.monotonic() < deadline, "the link did not come back"


def test_tbf_holds_the_link_to_its_rate(net):
    a = net["a"]
    n = 2_500_000  # 20 Mbit: 0.4 s at 50 Mbit/s
    a.shape("50mbit")
    try:
        took = float(send(net, "b", a.addr, n, timeout=30)[2])
    finally:
        a.unshape()
    assert took >= 0.3, took
    fast = float(send(net, "b", a.addr, n)[2])
    assert fast < took / 3, (fast, took)


def test_nothing_of_a_run_remains(netns, tmp_path):
    net = cluster.Net(["x"], tmp_path).start()
    try:
        x = net["x"]
        assert x.run(["sh", "-c", "echo hi > /dev/shm/seg; ls /dev/shm"]).stdout.split() == ["seg"]
        assert net.shm_entries() == {"x": ["seg"]}
        x.popen(["sleep", "300"], log=tmp_path / "sleep.log")
        x.popen(["sh", "-c", "sleep 300 & sleep 300"], log=tmp_path / "sh.log")
        time.sleep(0.3)
        assert len(x.pids()) >= 3  # the two sleeps of sh, and sh itself where it does not exec
        left = net.leftovers()
        assert any(s.startswith("namespace") for s in left) and any("process" in s for s in left)
    finally:
        net.stop()
    assert net.leftovers() == []
    assert not Path(f"/sys/class/net/{x.veth}").exists()


def test_a_cut_between_two_hosts_leaves_the_others(net):
    a, b = net["a"], net["b"]
    b.cut_from(a)
    try:
        status, kind, _ = send(net, "b", a.addr, 10, timeout=1.5)
        assert (status, kind) == ("error", "TimeoutError")
        # The test's own namespace still reaches a.
        with socket.create_connection((a.addr, PORT), timeout=5) as s:
            s.sendall(b"xyz")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(64) == b"3"
    finally:
        b.heal_from(a)
    assert send(net, "b", a.addr, 10)[0] == "ok"


def test_a_check_before_stop_sees_the_others_ended_and_reports_what_is_held(netns, tmp_path):
    net = cluster.Net(["x"], tmp_path).start()
    try:
        x = net["x"]
        kept = x.popen(["sleep", "300"], log=tmp_path / "kept.log")
        other = x.popen(["sleep", "300"], log=tmp_path / "other.log")
        seen: list[tuple[int | None, int | None]] = []

        def check() -> list[str]:
            seen.append((other.poll(), kept.poll()))
            return ["segment of the run"]

        net.check_before_stop(check, keep=[kept])
    finally:
        net.stop()
    assert seen[0][0] is not None and seen[0][1] is None  # the other ended, the kept one not
    assert net.leftovers() == ["segment of the run"] and kept.poll() is not None


def test_refusing_a_hosts_connections_is_one_way(net):
    """`a.refuse_from(b, PORT)`: b's connections to a's PORT hang (dropped, as a firewall on a's
    side drops them), while a's connections to b work both ways, data and answer, and so do
    the test's to a; without a port every port of a is refused to b; `accept_from` lifts it."""
    a, b = net["a"], net["b"]
    log = net.work / "sink-b.log"
    sink = b.popen([sys.executable, str(SINK), b.addr, str(PORT)], log=log)
    for _ in range(100):
        if log.exists() and "listening" in log.read_text():
            break
        assert sink.poll() is None, log.read_text()
        time.sleep(0.05)
    try:
        for port in (PORT, None):
            a.refuse_from(b, port)
            try:
                status, kind, took = send(net, "b", a.addr, 10, timeout=1.5)
                assert (status, kind) == ("error", "TimeoutError") and float(took) >= 1.4
                # The other way: a opens a connection to b, sends, and hears b's answer.
                assert send(net, "a", b.addr, 100_000)[:2] == ["ok", "100000"]
                with socket.create_connection((a.addr, PORT), timeout=5) as s:
                    s.sendall(b"xyz")
                    s.shutdown(socket.SHUT_WR)
                    assert s.recv(64) == b"3"
            finally:
                a.accept_from()
            assert send(net, "b", a.addr, 10)[:2] == ["ok", "10"]
    finally:
        sink.terminate()
        sink.wait(10)
