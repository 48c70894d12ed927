"""An emulated network on one machine: a star of Linux network namespaces with rate-limited links.

GRACE (Section 5) measures compressors at several link speeds; this module builds a star of nodes:
each node is a network namespace, joined to a bridge (its own namespace too) by one veth pair, with a
token-bucket filter (``tc qdisc … tbf rate RATE burst 256kb latency 50ms``) on both ends of every link.
A node hosts k workers: with k = 1 every local worker has its own namespace and link; with k > 1 the
workers of a node share its namespace, and talk to each other through it (traffic between two local
addresses goes through the namespace's loopback, never through the veth: unshaped, as inside a
machine), while traffic to other nodes crosses the node's rate-limited link, as between machines.
Workers run inside their node's namespace with ``GLOO_SOCKET_IFNAME=eth0`` so Gloo uses that link.
Addresses are private and exist only inside the namespaces created here; everything is deleted on exit,
also when a worker fails or the user presses Ctrl-C. Needs root and iproute2.

``netem`` delay is not available in every kernel; latency, where needed, is modelled in software by
the cost model (``gradpress sim``), not here.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Iterator, Sequence

from gradpress.costmodel import rate_bits_per_second

SUBNET = "10.213.0"  # only ever configured inside the namespaces created here
INTERFACE = "eth0"
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?$", re.I)
#: tc's size units (iproute2's ``get_size``: binary prefixes for bytes, ``…bit`` for bits)
_SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
               "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8}
#: the token bucket and queue bound of every emulated link (``tbf … burst BURST latency LATENCY``)
BURST = "256kb"
QUEUE_LATENCY = "50ms"
#: the most nodes (namespaces) one star holds: their addresses are SUBNET.1 … SUBNET.250
MAX_NODES = 250


class NetworkUnavailable(RuntimeError):
    """The emulated network can't be built here (not root, or no iproute2)."""


def size_bytes(size: str | float) -> float:
    """A tc size in bytes: ``"256kb"`` -> 262144 (tc(8): b, k/kb, m/mb, g/gb are bytes with binary
    prefixes, kbit/mbit/gbit bits); a number is bytes already."""
    if not isinstance(size, str):
        value = float(size)
    else:
        match = _SIZE.match(size.strip())
        if not match:
            raise ValueError(f"size {size!r}: expected bytes or a tc size, e.g. 256kb or 1mb")
        value = float(match[1]) * _SIZE_UNITS[(match[2] or "b").lower()]
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"size {size!r}: expected a finite number of bytes ≥ 0")
    return value


@dataclass(frozen=True)
class Star:
    """A built star: ``namespaces[i]`` is node i, at ``addresses[i]`` on its ``eth0``; it holds the
    ``workers_per_node`` workers (ranks) i·k … i·k + k − 1."""

    bridge: str
    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    rate: str
    burst: str = BURST
    latency: str = QUEUE_LATENCY
    workers_per_node: int = 1

    def node(self, rank: int) -> int:
        """The node that holds worker ``rank``."""
        if not 0 <= rank < len(self.namespaces) * self.workers_per_node:
            raise ValueError(f"worker {rank} is not on this star of {len(self.namespaces)} nodes of "
                             f"{self.workers_per_node} workers")
        return rank // self.workers_per_node

    def settings(self) -> dict[str, object]:
        """What a run records of its links (``Run.info["network"]``): the tbf on both ends of each link,
        and its bucket in bytes (what the cost model's ``burst`` takes)."""
        return {"qdisc": "tbf", "rate": self.rate, "burst": self.burst, "burst_bytes": size_bytes(self.burst),
                "latency": self.latency}

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace of worker ``rank``'s node."""
        return ["ip", "netns", "exec", self.namespaces[self.node(rank)], *argv]

    def environment(self, rank: int) -> dict[str, str]:
        """Variables a worker needs: Gloo on its node's link, rendezvous at worker 0 (on node 0)."""
        self.node(rank)
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "MASTER_ADDR": self.addresses[0]}


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetworkUnavailable("the emulated network (--bandwidth) needs root: network namespaces and tc "
                                 "need CAP_NET_ADMIN; run as root or leave --bandwidth unset for loopback")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetworkUnavailable("the emulated network needs iproute2 (`ip`, `tc`): apt-get install iproute2")


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetworkUnavailable(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


def _prefix(pid: int) -> str:
    return f"gp{pid}-"


def namespaces_of(pid: int) -> list[str]:
    """Namespaces this module created for process ``pid`` that still exist."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names if name.startswith(_prefix(pid))]


def delete(namespaces: Sequence[str]) -> None:
    """Delete namespaces (their veth ends, qdiscs and addresses go with them); never raises."""
    for name in namespaces:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def cleanup_stale() -> list[str]:
    """Delete namespaces left by gradpress processes that no longer exist (e.g. killed with SIGKILL)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    stale = []
    for line in listing.splitlines():
        match = re.match(r"^gp(\d+)-\S+", line.strip())
        if match and not _alive(int(match[1])):
            stale.append(match[0])
    delete(stale)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build(nodes: int, rate: str, burst: str = BURST, latency: str = QUEUE_LATENCY,
          workers_per_node: int = 1) -> Star:
    """Create the star of ``nodes`` namespaces, each to hold ``workers_per_node`` workers; on any failure,
    delete what was created and raise :class:`NetworkUnavailable`."""
    check_available()
    rate_bits_per_second(rate)  # validate before touching anything
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"the emulated network holds 1..{MAX_NODES} nodes (namespaces), got {nodes}")
    if isinstance(workers_per_node, bool) or not isinstance(workers_per_node, int) or workers_per_node < 1:
        raise ValueError(f"workers_per_node must be a positive integer, got {workers_per_node!r}")
    prefix = _prefix(os.getpid())
    bridge = prefix + "br"
    names = tuple(f"{prefix}n{i}" for i in range(nodes))
    addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(nodes))
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
    created: list[str] = []
    try:
        for name in (bridge, *names):
            _run("ip", "netns", "add", name)
            created.append(name)
        _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(names, addresses, strict=True)):
            port = f"port{i}"
            _run("ip", "link", "add", INTERFACE, "netns", name, "type", "veth", "peer", "name", port, "netns", bridge)
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _run("ip", "-n", name, "link", "set", INTERFACE, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", bridge, "link", "set", port, "master", "br0")
            _run("ip", "-n", bridge, "link", "set", port, "up")
            _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", INTERFACE, *tbf)
            _run("ip", "netns", "exec", bridge, "tc", "qdisc", "add", "dev", port, *tbf)
    except BaseException:
        delete(created)
        raise
    return Star(bridge, names, addresses, rate, burst, latency, workers_per_node)


@contextlib.contextmanager
def emulated_star(nodes: int, rate: str, burst: str = BURST, latency: str = QUEUE_LATENCY,
                  workers_per_node: int = 1) -> Iterator[Star]:
    """Build the star (:func:`build`) for the duration of a ``with`` block and delete it afterwards,
    whatever happens.

    SIGTERM is turned into an exception while the block runs, so ``kill`` cleans up like Ctrl-C does.
    """
    star = build(nodes, rate, burst, latency, workers_per_node)
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = _is_main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield star
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        delete((star.bridge, *star.namespaces))


def link_sent_bytes(interface: str = INTERFACE) -> int:
    """Bytes sent so far over ``interface`` of the calling process's network namespace (the kernel's
    counter, ``/sys/class/net/IF/statistics/tx_bytes``): inside a node's namespace, what all its workers
    sent to other nodes over its link, frames' headers included."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as counter:
        return int(counter.read())


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
