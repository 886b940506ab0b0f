"""The namespace twin for real (root): shaped rate, kernel byte classes, a swarm across it, no leftovers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmtrain.daemon.cli import COMMANDS
from swarmtrain.process.children import group_alive
from swarmtrain.telemetry.events import RoundEvent
from swarmtrain.testbed import LinkSpec, Testbed, TestbedError, find_testbeds, read_counters
from swarmtrain.testbed.counters import read_rate_bit_s
from swarmtrain.testbed.cpu import caps_of, cgroup_root
from swarmtrain.testbed.netns import has_netem
from swarmtrain.testbed.rates import LinkRateSampler
from swarmtrain.testbed.swarm import TestbedSwarm

pytestmark = [pytest.mark.system, pytest.mark.root, pytest.mark.timeout(240)]

if os.geteuid() != 0:
    pytest.skip("the namespace testbed needs root (ip netns, veth, tc need CAP_NET_ADMIN)", allow_module_level=True)
if shutil.which("ip") is None or shutil.which("tc") is None:
    pytest.skip("the namespace testbed needs iproute2 (`ip`, `tc`)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
RECEIVER = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("READY", flush=True)
c, _ = s.accept(); n = 0; first = last = None
while chunk := c.recv(1 << 16):
    last = time.monotonic(); first = first or last; n += len(chunk)
print(json.dumps({"bytes": n, "seconds": last - first}), flush=True)
"""
SENDER = "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); " \
         "s.sendall(b'x' * int(sys.argv[3])); s.close()"


@pytest.fixture
def name() -> Iterator[str]:
    """A testbed name of this test process; asserts nothing of it is left afterwards."""
    tb_name = f"ci{os.getpid() % 100_000}"
    yield tb_name
    assert tb_name not in find_testbeds(), f"namespaces of testbed {tb_name} were left behind"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"{tb_name}-" not in links
    assert not caps_of(tb_name), f"CPU cgroups of testbed {tb_name} were left behind"


def _transfer(tb: Testbed, *, src: int, dst: int, port: int, size_bytes: int) -> dict[str, float]:
    recv = tb.spawn(dst, [sys.executable, "-c", RECEIVER, tb.host(dst).ip, str(port)],
                    stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None and recv.stdout.readline().strip() == "READY"
    send = tb.spawn(src, [sys.executable, "-c", SENDER, tb.host(dst).ip, str(port), str(size_bytes)])
    assert send.wait(timeout=60) == 0
    result = json.loads(recv.stdout.readline())
    assert recv.wait(timeout=10) == 0
    return result


def test_link_rate_sampler_sees_the_shaped_rate_per_direction(name: str) -> None:
    rate = 20_000_000
    with Testbed(name, num_hosts=2, link=LinkSpec(rate_bit_s=rate)) as tb:
        with LinkRateSampler([h.netns for h in tb.hosts], interval_s=0.05) as sampler:
            _transfer(tb, src=0, dst=1, port=tb.data_port, size_bytes=2_500_000)  # ~1 s at the shaped rate
        sender, receiver = sampler.series()

    assert sender.tx_bytes[-1] - sender.tx_bytes[0] >= 2_500_000  # every byte passed the sender's link
    assert receiver.rx_bytes[-1] - receiver.rx_bytes[0] >= 2_500_000
    up = sender.peak_bit_s(window_s=0.5)["upload"]
    down = receiver.peak_bit_s(window_s=0.5)["download"]
    # the veth's counters count a GSO packet's headers once, so they sit a little under the htb rate
    assert 0.85 * rate <= up <= 1.05 * rate, up
    assert 0.85 * rate <= down <= 1.05 * rate, down
    assert receiver.peak_bit_s(window_s=0.5)["upload"] < 0.1 * rate  # only ACKs go back


def test_shaped_link_rate_and_kernel_byte_classes(name: str) -> None:
    rate = 20_000_000
    with Testbed(name, num_hosts=3, link=LinkSpec(rate_bit_s=rate)) as tb:
        assert set(find_testbeds()[name]) == {f"{name}-sw", f"{name}-h0", f"{name}-h1", f"{name}-h2"}
        assert read_rate_bit_s(name, 1) == rate
        before = read_counters(name)
        data = _transfer(tb, src=0, dst=1, port=tb.data_port, size_bytes=2_500_000)
        other = _transfer(tb, src=0, dst=2, port=7100, size_bytes=1_000_000)
        delta = {i: c.minus(before[i]) for i, c in read_counters(name).items()}
        procs = list(tb._procs)

    assert data["bytes"] == 2_500_000 and other["bytes"] == 1_000_000
    measured_bit_s = 8 * data["bytes"] / data["seconds"]
    assert 0.85 * rate <= measured_bit_s <= 1.1 * rate, f"shaped to {rate} bit/s, measured {measured_bit_s:.0f}"
    up0, down1, down2 = delta[0].upload, delta[1].download, delta[2].download
    # The data-port transfer lands in the data class on both shaped ends, headers removed it is the payload.
    assert abs(up0.data_payload_bytes - 2_500_000) < 200, up0
    assert down1.data_bytes == up0.data_bytes and down1.other_bytes < 2_000
    # The other port's transfer is counted, but never as data plane.
    assert down2.data_bytes == 0 and down2.other_bytes > 1_000_000
    assert up0.total_bytes == up0.data_bytes + up0.other_bytes
    assert all(not group_alive(p.pid) for p in procs)


ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("READY", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while b := c.recv(1):
    c.sendall(b)
"""
PINGER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.monotonic(); s.sendall(b"x"); s.recv(1); rtts.append(time.monotonic() - t)
print(min(rtts), max(rtts), flush=True)
"""


def _tcp_rtt_s(tb: Testbed, *, src: int, dst: int, port: int) -> tuple[float, float]:
    """(min, max) of 5 one-byte TCP round trips from host `src` to an echo on host `dst`."""
    echo = tb.spawn(dst, [sys.executable, "-c", ECHO, tb.host(dst).ip, str(port)], stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdout.readline().strip() == "READY"
    ping = tb.spawn(src, [sys.executable, "-c", PINGER, tb.host(dst).ip, str(port)], stdout=subprocess.PIPE,
                    text=True)
    assert ping.stdout is not None
    low, high = (float(x) for x in ping.stdout.readline().split())
    assert ping.wait(timeout=30) == 0
    return low, high


def test_a_delay_without_netem_is_held_by_the_forwarder_both_ways(name: str) -> None:
    """10 ms on each end of each link, held in user space: a TCP round trip between two hosts takes 4 x 10 ms,
    a bulk transfer still runs at the shaped rate with every byte through the forwarder's ports, and `down`
    stops the forwarder with the namespaces."""
    rate = 20_000_000
    link = LinkSpec(rate_bit_s=rate, delay_ms=10)
    with Testbed(name, num_hosts=3, link=link, delay_by="forwarder") as tb:
        assert tb.describe()["link"]["delay_by"] == "forwarder"
        assert read_rate_bit_s(name, 1) == rate
        low, high = _tcp_rtt_s(tb, src=0, dst=1, port=7100)
        data = _transfer(tb, src=0, dst=1, port=tb.data_port, size_bytes=2_500_000)
        forwarder = tb.forwarder_pid
        stats = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the forwarder writes its counters every second
            stats = tb.forwarder_stats()
            if stats is not None and stats["ports"]["h1"]["down"]["bytes"] >= 2_500_000:
                break
            time.sleep(0.1)

    assert forwarder is not None and not group_alive(forwarder)
    assert 0.040 <= low <= high < 0.040 + 0.030, (low, high)
    assert data["bytes"] == 2_500_000
    assert 8 * data["bytes"] / data["seconds"] <= 1.1 * rate
    assert stats is not None and stats["delay_ms"] == 10
    ports = stats["ports"]
    assert ports["h0"]["up"]["bytes"] >= 2_500_000 and ports["h1"]["down"]["bytes"] >= 2_500_000
    assert ports["h2"]["down"]["bytes"] < 10_000  # the bridge sent host 2 nothing but broadcasts


def test_loss_without_netem_is_refused_and_leaves_nothing(name: str) -> None:
    tb = Testbed(name, num_hosts=2, link=LinkSpec(rate_bit_s=1_000_000, delay_ms=5, loss_pct=1),
                 delay_by="forwarder")
    with pytest.raises(TestbedError, match="--loss-pct needs netem"):
        tb.up()


BUSY = """
import sys, time
wall = float(sys.argv[1]); start = time.monotonic(); cpu0 = time.process_time()
while time.monotonic() - start < wall:
    sum(range(1000))
print(time.process_time() - cpu0, time.monotonic() - start, flush=True)
"""


@pytest.mark.skipif(cgroup_root() is None, reason="no cpu cgroup controller on this kernel")
def test_a_capped_host_computes_at_most_its_cores(name: str) -> None:
    """A busy loop in a host capped at 0.25 CPUs gets at most a quarter of the wall time (the kernel's
    quota, whatever the machine's load), and the cap's throttle counter says it was held back."""
    with Testbed(name, num_hosts=3, link=LinkSpec(rate_bit_s=100_000_000), cpus={0: 0.5, 1: 0.25}) as tb:
        caps = caps_of(name)
        assert [(c.host, c.cores()) for c in caps] == [(0, 0.5), (1, 0.25)]  # host 2: uncapped
        assert tb.exec_argv(2, ["true"]) == ["ip", "netns", "exec", f"{name}-h2", "true"]
        busy = tb.spawn(1, [sys.executable, "-c", BUSY, "2.0"], stdout=subprocess.PIPE, text=True)
        out, _ = busy.communicate(timeout=60)
        cpu_s, wall_s = (float(x) for x in out.split())
        assert cpu_s <= 0.25 * wall_s + 0.05, (cpu_s, wall_s)  # + one 10 ms period of slack, and then some
        periods, held_s = caps[1].throttled()
        assert periods > 0 and held_s > 0.5 * wall_s, (periods, held_s)
        assert caps[0].throttled() == (0, 0.0)  # the other host's group did nothing
    assert not caps_of(name)


def test_entrypoint_shapes_and_resolves_ip_and_join(name: str, tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "swarmtrain").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (fake_bin / "swarmtrain").chmod(0o755)
    ready = tmp_path / "coordinator.ready"
    ready.write_text('READY {"maddrs": ["/ip4/127.0.0.1/tcp/7002/p2p/QmC", "/ip4/10.77.0.10/tcp/7002/p2p/QmC"]}\n')
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SWARMTRAIN_JOIN_FILE": str(ready)}
    entry = ["bash", str(REPO / "docker" / "entrypoint.sh")]
    with Testbed(name, num_hosts=1, link=LinkSpec(rate_bit_s=100_000_000)) as tb:
        assert tb.spawn(0, ["tc", "qdisc", "del", "dev", "eth0", "root"]).wait(timeout=20) == 0
        ok = tb.spawn(0, [*entry, "peer", "--join", "{join}", "--announce", "{ip}:7000"],
                      env={**env, "SHAPE_RATE": "5mbit"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = ok.communicate(timeout=30)
        assert ok.returncode == 0, err
        assert out.split() == ["peer", "--join", "/ip4/10.77.0.10/tcp/7002/p2p/QmC", "--announce", "10.77.0.10:7000"]
        shaped = subprocess.run(["tc", "-n", f"{name}-h0", "class", "show", "dev", "eth0"],
                                capture_output=True, text=True, check=True).stdout
        assert "rate 5Mbit" in shaped
        netem = has_netem(tb.switch_ns)
        delayed = tb.spawn(0, [*entry, "peer"], env={**env, "SHAPE_RATE": "5mbit", "SHAPE_DELAY_MS": "20"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = delayed.communicate(timeout=30)
        if not netem:  # this kernel: said plainly, never emulated silently
            assert delayed.returncode == 2 and "no netem qdisc" in err
        no_ready = tb.spawn(0, [*entry, "peer", "--join", "{join}"], stderr=subprocess.PIPE, text=True,
                            env={**env, "SWARMTRAIN_JOIN_FILE": str(tmp_path / "absent"),
                                 "SWARMTRAIN_JOIN_TIMEOUT_S": "1"})
        _, err = no_ready.communicate(timeout=30)
        assert no_ready.returncode == 2 and "no READY line" in err


# Tiny model and short windows: a round is ~1-2 s of compute; the links are shaped to 50 Mbit/s.
TINY_RUN = [
    "model.preset=tiny", "data.max_corpus_bytes=400000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", "diloco.inner_steps=5", "diloco.rounds=4", "diloco.eval_batches=1",
    "averaging.min_peers=2", "averaging.matchmaking_timeout_s=2.0", "averaging.allreduce_timeout_s=10.0",
    "averaging.contribution_window_s=3.0", "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=3.0", "train.threads=1",
]


@pytest.mark.skipif("peer" not in COMMANDS, reason="`swarmtrain peer` is not registered in COMMANDS yet")
def test_coordinator_and_two_peers_train_across_the_testbed(name: str, tmp_path: Path) -> None:
    rounds = 4
    with Testbed(name, num_hosts=3, link=LinkSpec(rate_bit_s=50_000_000)) as tb, \
            TestbedSwarm(tb, log_dir=tmp_path / "logs", run_overrides=TINY_RUN) as swarm:
        join = swarm.start_coordinator(host=0, timeout_s=90)
        assert join.startswith("/ip4/10.77.0.10/")
        peers = [swarm.start_peer(p, host=h) for p, h in (("a", 1), ("b", 2))]
        for p in peers:
            p.wait_ready(timeout_s=90)
        for p in peers:
            p.wait_for(lambda x: isinstance(x, RoundEvent) and x.round >= rounds - 1, timeout_s=120,
                       what=f"round {rounds - 1}")
        counters = read_counters(name)
        events = {n: swarm.rounds(n) for n in ("a", "b")}
        pgids = [c.pgid for c in [*peers, swarm.coordinator] if c is not None]

    by_round: dict[int, set[str]] = defaultdict(set)
    for evs in events.values():
        for e in evs:
            if e.committed:
                by_round[e.round].add(e.hash)
    assert len(by_round) >= rounds - 1, f"too few committed rounds: {events}"
    assert all(len(h) == 1 for h in by_round.values()), f"peers committed different θ_global: {dict(by_round)}"
    # The peers' data plane crossed the shaped bridge (hosts 1 and 2), not loopback.
    sent = sum(e.bytes_sent for evs in events.values() for e in evs)
    wire = counters[1].upload.data_payload_bytes + counters[2].upload.data_payload_bytes
    assert sent > 0 and wire >= sent, f"swarmtrain sent {sent} B, the kernel saw {wire} B of TCP payload"
    assert all(not group_alive(g) for g in pgids), "a swarmtrain process survived teardown"
