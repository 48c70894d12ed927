"""The emulated network: built, rate-limited, and always deleted (needs root; skipped otherwise)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gradpress.testbed import netem

root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")


def test_rate_parsing():
    assert netem.rate_bits_per_second("100mbit") == 1e8
    assert netem.rate_bits_per_second("1gbit") == 1e9
    assert netem.rate_bits_per_second("2.5 Mbit") == 2.5e6
    with pytest.raises(ValueError, match="100mbit"):
        netem.rate_bits_per_second("100 megabits")


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the message a non-root user gets")
def test_not_root_gives_a_clear_error():
    with pytest.raises(netem.NetworkUnavailable, match="needs root"):
        netem.check_available()


RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0; start = None
while True:
    data = c.recv(1 << 20)
    if not data: break
    start = start or time.perf_counter(); n += len(data)
print(n * 8 / (time.perf_counter() - start))
"""
SENDER = """
import socket, sys, time
for _ in range(100):
    try: s = socket.create_connection((sys.argv[1], 5001), timeout=20); break
    except OSError: time.sleep(0.05)
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])): s.sendall(block)
s.close()
"""


@root
def test_star_limits_rate_and_is_deleted():
    with netem.emulated_star(2, "100mbit") as star:
        assert set(netem.namespaces_of(os.getpid())) == {star.bridge, *star.namespaces}
        receiver = subprocess.Popen(star.command(1, [sys.executable, "-c", RECEIVER, star.addresses[1]]),
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        subprocess.run(star.command(0, [sys.executable, "-c", SENDER, star.addresses[1], "12"]),
                       check=True, timeout=60)
        bits_per_second = float(receiver.communicate(timeout=60)[0])
        # a 100 Mbit/s token bucket: well below loopback's tens of Gbit/s, close to the configured rate
        assert 60e6 < bits_per_second < 130e6
        assert star.environment(0)["GLOO_SOCKET_IFNAME"] == "eth0"
    assert netem.namespaces_of(os.getpid()) == []


@root
def test_star_is_deleted_when_the_block_raises():
    with pytest.raises(RuntimeError, match="worker failed"):
        with netem.emulated_star(3, "1gbit"):
            raise RuntimeError("worker failed")
    assert netem.namespaces_of(os.getpid()) == []


@root
def test_stale_namespaces_of_dead_processes_are_cleaned():
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    name = f"gp{dead_pid}-w0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netem.cleanup_stale()
    finally:
        netem.delete([name])
    assert netem.namespaces_of(dead_pid) == []


def test_tc_sizes_and_the_settings_a_run_records():

    # tc(8): sizes in bytes with binary prefixes, ...bit in bits
    assert netem.size_bytes("256kb") == 262144 and netem.size_bytes("1mb") == 1024 ** 2
    assert netem.size_bytes("8kbit") == 1024 and netem.size_bytes("1500") == 1500
    assert netem.size_bytes(1000.0) == 1000.0
    with pytest.raises(ValueError, match="tc size"):
        netem.size_bytes("lots")
    star = netem.Star("br", ("n0",), ("10.213.0.1",), "100mbit")
    assert star.settings() == {"qdisc": "tbf", "rate": "100mbit", "burst": "256kb", "burst_bytes": 262144,
                               "latency": "50ms"}


def test_the_node_form_puts_k_workers_in_each_namespace():
    """Workers i·k … i·k + k − 1 run in node i's namespace, all with Gloo on its link and the rendezvous
    at node 0; the per-worker star is the same star with k = 1."""
    names, addresses = ("gp1-n0", "gp1-n1", "gp1-n2"), ("10.213.0.1", "10.213.0.2", "10.213.0.3")
    nodes = netem.Star("gp1-br", names, addresses, "100mbit", workers_per_node=2)
    assert [nodes.command(rank, ["true"])[3] for rank in range(6)] == [name for name in names for _ in "ab"]
    assert {nodes.environment(rank)["MASTER_ADDR"] for rank in range(6)} == {addresses[0]}
    assert {nodes.environment(rank)["GLOO_SOCKET_IFNAME"] for rank in range(6)} == {"eth0"}
    with pytest.raises(ValueError, match="worker 6 is not on this star of 3 nodes of 2 workers"):
        nodes.command(6, ["true"])
    workers = netem.Star("gp1-br", names, addresses, "100mbit")
    assert [workers.command(rank, ["true"])[3] for rank in range(3)] == list(names)


@root
def test_node_namespaces_keep_their_own_traffic_off_the_link_and_are_deleted():
    """Two workers of one node talk through their namespace (the link's counter does not move with their
    12 MiB); a worker of the other node reaches them over the link (its counter counts the 12 MiB)."""
    blocks = 12
    with netem.emulated_star(2, "1gbit", workers_per_node=2) as star:
        assert set(netem.namespaces_of(os.getpid())) == {star.bridge, *star.namespaces}
        assert star.command(0, ["true"]) == star.command(1, ["true"]) != star.command(2, ["true"])

        def link_bytes(rank: int) -> int:  # what netem.link_sent_bytes reads, in the rank's namespace
            counter = f"/sys/class/net/{netem.INTERFACE}/statistics/tx_bytes"
            return int(subprocess.run(star.command(rank, ["cat", counter]), capture_output=True, text=True,
                                      check=True, timeout=60).stdout)

        def send(sender: int, receiver: int) -> None:
            address = star.addresses[star.node(receiver)]
            listening = subprocess.Popen(star.command(receiver, [sys.executable, "-c", RECEIVER, address]),
                                         stdout=subprocess.PIPE, text=True)
            subprocess.run(star.command(sender, [sys.executable, "-c", SENDER, address, str(blocks)]),
                           check=True, timeout=60)
            listening.communicate(timeout=60)

        before = link_bytes(0)
        send(1, 0)  # inside node 0
        inside = link_bytes(0) - before
        send(0, 2)  # from node 0 to node 1
        across = link_bytes(0) - before - inside
        assert inside < (1 << 20) and across >= blocks << 20
    assert netem.namespaces_of(os.getpid()) == []
