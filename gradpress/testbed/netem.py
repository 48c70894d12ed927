"""An emulated network on one machine: a star of Linux network namespaces with rate-limited links.

GRACE (Section 5) measures compressors at several link speeds; this module gives every local worker
its own network namespace, joined to a bridge (its own namespace too) by one veth pair per worker, with a
token-bucket filter (``tc qdisc … tbf rate RATE burst 256kb latency 50ms``) on both ends of every link.
Workers run inside their namespace with ``GLOO_SOCKET_IFNAME=eth0`` so Gloo uses the limited link.
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
    """A built star: ``namespaces[i]`` holds worker i at ``addresses[i]`` on its ``eth0``."""

    bridge: str
    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    rate: str
    burst: str = BURST
    latency: str = QUEUE_LATENCY

    def settings(self) -> dict[str, object]:
        """What a run records of its links (``Run.info["network"]``): the tbf on both ends of each link,
        and its bucket in bytes (what the cost model's ``burst`` takes)."""
        return {"qdisc": "tbf", "rate": self.rate, "burst": self.burst, "burst_bytes": size_bytes(self.burst),
                "latency": self.latency}

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[rank], *argv]

    def environment(self, rank: int) -> dict[str, str]:
        """Variables a worker needs: Gloo on the limited interface, rendezvous at worker 0."""
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


def build(workers: int, rate: str, burst: str = BURST, latency: str = QUEUE_LATENCY) -> Star:
    """Create the star; on any failure, delete what was created and raise :class:`NetworkUnavailable`."""
    check_available()
    rate_bits_per_second(rate)  # validate before touching anything
    if not 1 <= workers <= 250:
        raise ValueError(f"workers must be in 1..250 for the emulated network, got {workers}")
    prefix = _prefix(os.getpid())
    bridge = prefix + "br"
    names = tuple(f"{prefix}w{i}" for i in range(workers))
    addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(workers))
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
    return Star(bridge, names, addresses, rate, burst, latency)


@contextlib.contextmanager
def emulated_star(workers: int, rate: str, burst: str = BURST,
                  latency: str = QUEUE_LATENCY) -> Iterator[Star]:
    """Build the star for the duration of a ``with`` block and delete it afterwards, whatever happens.

    SIGTERM is turned into an exception while the block runs, so ``kill`` cleans up like Ctrl-C does.
    """
    star = build(workers, rate, burst, latency)
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


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
