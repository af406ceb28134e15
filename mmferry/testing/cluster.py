"""Hosts as Linux network namespaces on one bridge: a cluster on one machine whose hosts have
their own network stacks, for tests of mmferry across hosts.

Each host is a namespace with one veth whose other end sits on the run's bridge; the host's
address is in 198.18.0.0/15 (reserved for network benchmarking), in a /24 no other interface
of the machine uses, and the root namespace (the test itself) is `.1` on the bridge. Nothing is
routed anywhere else: the hosts have no default route. Between hosts a peer vanishes the way it
does on a network: `Host.down()` takes its link down (its processes live on; packets to it are
dropped, so a connect hangs until its timeout rather than being refused), `Host.shape(rate)`
puts a token-bucket filter (tbf) on both directions of its link, `Host.refuse_from(other)` drops
the connections one host opens to another (one way: a firewall on the receiving side), and
`Host.counters()` reads the bytes its link carried. Each host also has its own /dev/shm (a
folder of the run bind-mounted over it inside the host's mount namespace), as separate machines
do: shared memory cannot carry anything between hosts, and what a host's processes leave there
is counted as theirs.

Every name (namespaces, links, the shm folders) carries the run's id, `Net.leftovers()` lists
what of the run remains, and `Net.stop()` ends the run's processes and deletes all of it. A
service that outlives its clients' traces (a Mooncake master, which lists the segments its
clients mounted) is asked at `stop()` what it still holds of the run once every other process
has ended (`Net.check_before_stop`); what it answers is a leftover too.
Root and the kernel's namespaces are needed; `unavailable()` says why not when they are not.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "Net", "unavailable"]

RANGE = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "mf"  # every name of a run starts with this and the run's id
SHM = Path("/dev/shm")
NOWHERE = "02:00:00:00:00:01"  # a locally administered MAC no host of a run has


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why a cluster cannot be built here (not root, no `ip`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = f"{PREFIX}probe{secrets.token_hex(3)}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _ip("-o", "-4", "addr", "show").stdout.split()
    return [ipaddress.ip_interface(w).network for w in out if "/" in w and w[0].isdigit()]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    subnets = list(RANGE.subnets(new_prefix=24))
    # Random rather than first free: two runs starting at once rarely pick the same one, and
    # the address add below fails (rather than sharing) if they do.
    for i in secrets.SystemRandom().sample(range(len(subnets)), len(subnets)):
        if not any(subnets[i].overlaps(n) for n in used):
            return subnets[i]
    raise RuntimeError(f"every /24 of {RANGE} is in use")


def _stats(dev: str, what: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/{what}").read_text())


@dataclass
class Host:
    """One host: a namespace, its address, its link to the bridge, the processes started in it."""

    name: str
    ns: str
    veth: str  # the link's end on the bridge (root namespace)
    inner: str  # the link's end inside the host
    addr: str
    shm: Path  # the folder mounted over /dev/shm inside the host
    procs: list[subprocess.Popen] = field(default_factory=list)
    shaped: bool = False  # shape() holds the link's qdiscs
    refusing: bool = False  # refuse_from() holds the bridge end's qdisc

    def command(self, args: list[str]) -> list[str]:
        """`args` run inside the host: its network namespace, its own /dev/shm."""
        mount = 'mount --bind "$0" /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.ns, "sh", "-c", mount, str(self.shm), *args]

    def popen(
        self, args: list[str], *, env: dict[str, str] | None = None, log: Path, **kwargs
    ) -> subprocess.Popen:
        """Start `args` inside the host (output to `log`); `Net.stop` ends it."""
        out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed when it ends
        try:
            proc = subprocess.Popen(
                self.command(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                **kwargs,
            )
        finally:
            out.close()
        self.procs.append(proc)
        return proc

    def run(
        self, args: list[str], timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run `args` inside the host to its end."""
        return subprocess.run(
            self.command(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )

    def down(self) -> None:
        """Cut the host off: its link goes down, its processes live on."""
        _ip("link", "set", self.veth, "down")

    def up(self) -> None:
        _ip("link", "set", self.veth, "up")

    def cut_from(self, other: Host) -> None:
        """Cut this host off from `other` only, both ways, silently (both keep every other
        peer): each one's neighbour entry for the other points at a MAC no host has, so their
        frames to each other are dropped on the bridge, as a partition between two racks."""
        for a, b in ((self, other), (other, self)):
            _ip(
                "-n",
                a.ns,
                "neigh",
                "replace",
                b.addr,
                "lladdr",
                NOWHERE,
                "dev",
                a.inner,
                "nud",
                "permanent",
            )

    def heal_from(self, other: Host) -> None:
        for a, b in ((self, other), (other, self)):
            _ip("-n", a.ns, "neigh", "del", b.addr, "dev", a.inner, check=False)

    def refuse_from(self, other: Host, port: int | None = None) -> None:
        """This host silently drops the TCP connections `other` opens to it (to `port`, or to
        any port), as a firewall on this host's side does; everything else passes, so the
        connections this host opens to `other` work both ways and those `other` opened before
        live on. One way, unlike `cut_from`. `accept_from` lifts every refusal."""
        # The link's end on the bridge sends what enters the host: an htb qdisc there (its
        # default class absent, so unmatched packets pass unshaped) with one class whose leaf
        # drops everything (blackhole), and u32 filters sending it `other`'s SYNs (SYN set, ACK
        # clear: byte 13 of the TCP header, after a 20-byte IP header). tc's drop action and
        # iptables need modules a bare kernel may lack; htb, blackhole and u32 are common.
        if self.shaped:
            raise RuntimeError(f"{self.name}'s link is shaped; refuse_from uses its qdisc")
        tc = ["tc", "filter", "add", "dev", self.veth, "parent", "1:", "protocol", "ip"]
        match = ["u32", "match", "ip", "src", f"{other.addr}/32"]
        match += ["match", "ip", "dst", f"{self.addr}/32", "match", "ip", "protocol", "6", "0xff"]
        match += ["match", "u8", "0x02", "0x12", "at", "33"]
        if port is not None:
            match += ["match", "ip", "dport", str(port), "0xffff"]
        if not self.refusing:
            for cmd in (
                ["qdisc", "add", "dev", self.veth, "root", "handle", "1:", "htb", "default", "99"],
                ["class", "add", "dev", self.veth, "parent", "1:", "classid", "1:2", "htb"]
                + ["rate", "1gbit"],
                ["qdisc", "add", "dev", self.veth, "parent", "1:2", "handle", "2:", "blackhole"],
            ):
                subprocess.run(["tc", *cmd], check=True, capture_output=True)
        subprocess.run([*tc, "prio", "1", *match, "flowid", "1:2"], check=True, capture_output=True)
        self.refusing = True

    def accept_from(self) -> None:
        """Lift every `refuse_from`."""
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True)
        self.refusing = False

    def shape(self, rate: str) -> None:
        """Limit both directions of the host's link to `rate` (tc's units: 1gbit, 10gbit)."""
        if self.refusing:
            raise RuntimeError(f"{self.name} refuses connections; shape uses its link's qdisc")
        self.shaped = True
        # burst: at least rate/HZ bytes, else tbf cannot reach its rate; a 1 ms worth is ample.
        bits = _rate_bits(rate)
        burst = max(bits // 8 // 1000, 64 * 1024)
        for dev, ns in ((self.veth, None), (self.inner, self.ns)):
            pre = ["ip", "netns", "exec", ns] if ns else []
            subprocess.run(
                [
                    *pre,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                ],
                check=True,
                capture_output=True,
            )

    def unshape(self) -> None:
        self.shaped = False
        for dev, ns in ((self.veth, None), (self.inner, self.ns)):
            pre = ["ip", "netns", "exec", ns] if ns else []
            subprocess.run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def counters(self) -> tuple[int, int]:
        """(bytes the host received, bytes it sent) over its link so far."""
        # The bridge end's tx is what went into the host, its rx what came out.
        return _stats(self.veth, "tx_bytes"), _stats(self.veth, "rx_bytes")

    def pids(self) -> list[int]:
        """Processes living in the host's namespace (started here, or their children)."""
        out = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out]


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: give it in bit, kbit, mbit or gbit")


class Net:
    """A run's hosts on one bridge. `start()` builds them, `stop()` removes every trace."""

    def __init__(self, hosts: list[str], work: Path) -> None:
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"host names repeat: {hosts}")
        self.run_id = f"{PREFIX}{secrets.token_hex(3)}"
        self.work = work
        self.bridge = f"{self.run_id}br"
        self.names = hosts
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.root_addr = ""
        self._checks: list[tuple[Callable[[], list[str]], list[subprocess.Popen]]] = []
        self._held: list[str] = []  # what the checks found

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> Net:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for attempt in range(3):
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            added = _ip("addr", "add", f"{self.subnet[1]}/24", "dev", self.bridge, check=False)
            if added.returncode == 0:
                break
            _ip("link", "del", self.bridge, check=False)
            if attempt == 2:
                raise RuntimeError(f"no free /24 in {RANGE}: {added.stderr}")
        self.root_addr = str(self.subnet[1])
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns = f"{self.run_id}-{name}"
            veth, inner = f"{self.run_id}h{i}", f"{self.run_id}h{i}i"
            addr = str(self.subnet[i + 2])
            shm = SHM / f"{self.run_id}-{name}"
            shm.mkdir(mode=0o1777)
            host = Host(name, ns, veth, inner, addr, shm)
            self.hosts[name] = host
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def check_before_stop(
        self, check: Callable[[], list[str]], keep: list[subprocess.Popen]
    ) -> None:
        """At `stop()`, once every process of the run but `keep` has ended, call `check`: what
        it returns (what the processes in `keep` still hold of the run) `leftovers()` reports."""
        self._checks.append((check, keep))

    def _end(self, spare: list[subprocess.Popen]) -> None:
        """End the run's processes but `spare` (TERM, then KILL after 10 s)."""
        procs = [p for h in self.hosts.values() for p in h.procs if p not in spare]
        for proc in procs:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def stop(self) -> None:
        """End every process of the run (TERM, then KILL after 10 s), the ones a check keeps
        last, and delete its namespaces, links and shm folders."""
        for check, keep in self._checks:
            self._end(spare=keep)
            try:
                self._held += check()
            except Exception as e:  # noqa: BLE001 - reported as a leftover, the run still ends
                self._held.append(f"check {check!r} failed: {type(e).__name__}: {e}")
        self._checks = []
        self._end(spare=[])
        for host in self.hosts.values():
            # Children that outlived their parent, still in the namespace: all of the run's.
            for pid in host.pids():
                _kill_pid(pid)
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
            _ip("link", "del", host.veth, check=False)
            shutil.rmtree(host.shm, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What of the run remains: namespaces, links, live processes, shm folders or files."""
        found = list(self._held)
        for ns in _ip("netns", "list").stdout.split("\n"):
            if ns.startswith(self.run_id):
                found.append(f"namespace {ns.split()[0]}")
        for line in _ip("-o", "link", "show").stdout.splitlines():
            dev = line.split(":")[1].strip().split("@")[0]
            if dev.startswith(self.run_id):
                found.append(f"link {dev}")
        for host in self.hosts.values():
            found += [f"process {p.pid} {p.args[-1]!r}" for p in host.procs if p.poll() is None]
        found += [f"/dev/shm entry {p}" for p in SHM.iterdir() if p.name.startswith(self.run_id)]
        return found

    def shm_entries(self) -> dict[str, list[str]]:
        """Each host's own /dev/shm entries now."""
        return {
            name: sorted(p.name for p in h.shm.iterdir()) if h.shm.exists() else []
            for name, h in self.hosts.items()
        }


def _signal(pid: int, sig: int) -> None:
    # The child leads its own session (start_new_session): signal its group, so a shell's or
    # a server's children go too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
