"""Link delay in user space, for kernels without netem: a forwarder in the switch namespace holds every frame
of a host's link for a fixed time in each direction.

With a delay, a host's veth does not join the bridge itself. Its switch end `hI` is a port of the forwarder,
and a TAP device `tI` stands on the bridge in its place:

    host eth0 ──veth── hI ⇄ forwarder (holds each frame delay_s) ⇄ tI ── br0 ── tJ ⇄ forwarder ⇄ hJ ── host J

A frame from host I waits delay_s on its way up (hI → tI) and delay_s on its way down at the receiver (tJ →
hJ): one way host to host is 2 × delay_s, as netem on each end of each link gives. The htb shaping stays on
the veth ends (eth0's egress is the upload, hI's the download), so a frame is shaped where it would be.

Frames travel as the kernel holds them: a GSO super-packet of up to 64 KiB passes as one unit with its
virtio-net header (PACKET_VNET_HDR on the port's packet socket, IFF_VNET_HDR on the TAP), so the forwarder
handles about rate / 64 KiB frames a second per direction instead of rate / MTU. The delay is constant, so
each direction is a FIFO. Frames the next device will not take (its queue full) are dropped and counted, as
a router does.

`swarmtrain testbed forward --delay-ms D --port hI:tI ...` runs it inside the switch namespace (`Testbed.up`
starts it): it prints `READY` once every port is open, writes its counters as JSON to `--stats` every second,
and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import resource
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

__all__ = ["DelayLine", "Forwarder", "PortStats", "open_port_socket", "open_tap"]

# linux/if_tun.h, linux/if_packet.h, linux/if_ether.h
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
ETH_P_ALL = 0x0003
VNET_HDR_BYTES = 10  # struct virtio_net_hdr: what both the TAP and the packet socket prepend
MAX_FRAME_BYTES = VNET_HDR_BYTES + 65_536 + 14 + 4  # a GSO super-packet, its Ethernet header and a VLAN tag
READS_PER_WAKE = 64  # frames taken from one device before the others get a turn
QUEUE_LIMIT_BYTES = 64 << 20  # frames held per direction at most: beyond, the link drops (a router's buffer)
STATS_EVERY_S = 1.0


@dataclass
class DirectionStats:
    frames: int = 0
    bytes: int = 0  # Ethernet frames' bytes (the virtio-net headers not counted)
    dropped: int = 0  # frames the next device refused, or over the held-bytes limit


@dataclass
class PortStats:
    """One host's two directions through the forwarder."""

    up: DirectionStats = field(default_factory=DirectionStats)  # host -> bridge (hI -> tI)
    down: DirectionStats = field(default_factory=DirectionStats)  # bridge -> host (tI -> hI)


class DelayLine:
    """Frames in order, each released `delay_s` after it entered; at most `limit_bytes` held at once."""

    def __init__(self, delay_s: float, *, limit_bytes: int = QUEUE_LIMIT_BYTES) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s}: must be >= 0")
        self.delay_s, self.limit_bytes = delay_s, limit_bytes
        self._frames: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held_bytes = 0

    def push(self, frame: bytes, *, now: float) -> bool:
        """Hold `frame` until now + delay_s; False (dropped) when the line is full."""
        if self.held_bytes + len(frame) > self.limit_bytes:
            return False
        self._frames.append((now + self.delay_s, frame))
        self.held_bytes += len(frame)
        return True

    def next_due(self) -> float | None:
        """When the oldest held frame is due, None when none is held."""
        return self._frames[0][0] if self._frames else None

    def pop_due(self, *, now: float) -> list[bytes]:
        """Every frame due by `now`, oldest first."""
        out = []
        while self._frames and self._frames[0][0] <= now:
            frame = self._frames.popleft()[1]
            self.held_bytes -= len(frame)
            out.append(frame)
        return out


def open_tap(name: str) -> int:
    """A non-blocking fd of the TAP device `name` (made with `ip tuntap add ... mode tap vnet_hdr`, or made
    here), frames prefixed with a virtio-net header and offloads on, so GSO super-packets pass whole."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_port_socket(dev: str) -> socket.socket:
    """A non-blocking packet socket on `dev` that reads what arrives on it (not what it sends) and writes
    frames out of it, each with a virtio-net header."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.bind((dev, ETH_P_ALL))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Port:
    """One host's link through the forwarder: its packet socket, its TAP, and a delay line each way."""

    def __init__(self, dev: str, tap: str, *, delay_s: float) -> None:
        self.dev, self.tap = dev, tap
        self.sock = open_port_socket(dev)
        try:
            self.tap_fd = open_tap(tap)
        except OSError:
            self.sock.close()
            raise
        self.up, self.down = DelayLine(delay_s), DelayLine(delay_s)
        self.stats = PortStats()

    def close(self) -> None:
        self.sock.close()
        os.close(self.tap_fd)


class Forwarder:
    """Moves frames between each host port and its TAP, each held `delay_s` (see the module's docstring)."""

    def __init__(self, ports: Sequence[tuple[str, str]], *, delay_s: float) -> None:
        if not ports:
            raise ValueError("Forwarder: no ports given")
        self.delay_s = delay_s
        self.ports: list[_Port] = []
        try:
            for dev, tap in ports:
                self.ports.append(_Port(dev, tap, delay_s=delay_s))
        except OSError:
            self.close()
            raise
        self._stopping = False
        self._selector = selectors.DefaultSelector()
        for port in self.ports:
            self._selector.register(port.sock.fileno(), selectors.EVENT_READ, (port, "up"))
            self._selector.register(port.tap_fd, selectors.EVENT_READ, (port, "down"))

    def close(self) -> None:
        for port in self.ports:
            port.close()
        self.ports.clear()

    def stop(self) -> None:
        """End `run` within a second (safe from a signal handler)."""
        self._stopping = True

    def run(self, *, stats_path: str | None = None) -> None:
        """Forward until `stop()`, writing counters to `stats_path` every second and once more at the end."""
        next_stats = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            due = [d for p in self.ports for d in (p.up.next_due(), p.down.next_due()) if d is not None]
            timeout = max(0.0, min(due) - now) if due else STATS_EVERY_S
            for key, _ in self._selector.select(min(timeout, STATS_EVERY_S)):
                port, direction = key.data
                self._take(port, direction)
            now = time.monotonic()
            for port in self.ports:
                self._release(port, now)
            if stats_path is not None and now >= next_stats:
                self.write_stats(stats_path)
                next_stats = now + STATS_EVERY_S
        if stats_path is not None:
            self.write_stats(stats_path)

    def _take(self, port: _Port, direction: str) -> None:
        line, stats = (port.up, port.stats.up) if direction == "up" else (port.down, port.stats.down)
        for _ in range(READS_PER_WAKE):
            try:
                frame = port.sock.recv(MAX_FRAME_BYTES) if direction == "up" else os.read(port.tap_fd, MAX_FRAME_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            if len(frame) <= VNET_HDR_BYTES:
                continue
            if not line.push(frame, now=time.monotonic()):
                stats.dropped += 1

    def _release(self, port: _Port, now: float) -> None:
        for frame in port.up.pop_due(now=now):
            self._send(port.stats.up, frame, lambda f: os.write(port.tap_fd, f))
        for frame in port.down.pop_due(now=now):
            self._send(port.stats.down, frame, port.sock.send)

    @staticmethod
    def _send(stats: DirectionStats, frame: bytes, write: Callable[[bytes], object]) -> None:
        try:
            write(frame)
        except OSError as e:
            # A full queue (ENOBUFS, EAGAIN) or a frame the device will not carry: the link drops it.
            if e.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.EMSGSIZE, errno.EINVAL, errno.ENETDOWN):
                raise
            stats.dropped += 1
            return
        stats.frames += 1
        stats.bytes += len(frame) - VNET_HDR_BYTES

    def stats(self) -> dict[str, object]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"delay_ms": self.delay_s * 1e3, "cpu_s": usage.ru_utime + usage.ru_stime,
                "ports": {p.dev: asdict(p.stats) for p in self.ports}}

    def write_stats(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, path)
