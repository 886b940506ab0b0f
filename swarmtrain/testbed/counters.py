"""Bytes on the wire as the kernel counted them: per-host htb class counters and interface stats.

Two sources, both read from inside the namespaces:

* tc class counters on the egress of each end of a host's veth (host end = upload, switch end =
  download), split into the data-plane class (TCP to/from the data port) and the rest. qdiscs
  count a GSO super-packet as the frames it becomes (headers of every segment included), so
  these are the L2 bytes a real link would carry (Ethernet header + IP + TCP + payload).
* interface counters (`ip -s link`) of the host's `eth0`; on a veth these count a GSO skb once,
  with one set of headers, so they run slightly below the tc figures. Reported for reference.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from swarmtrain.testbed.netns import find_testbeds, ip_json, tc_stats
from swarmtrain.testbed.shaping import DATA_CLASS, OTHER_CLASS, ROOT_CLASS, TestbedError

__all__ = [
    "TCP_FRAME_OVERHEAD_BYTES", "DirectionCounters", "HostCounters", "parse_htb_classes", "read_counters",
    "read_rate_bit_s", "total_wire_bytes",
]


@dataclass(frozen=True)
class DirectionCounters:
    """One direction of one host's link, from its htb classes."""

    total_bytes: int
    data_bytes: int  # TCP to/from the data-plane port
    other_bytes: int
    packets: int  # frames (a GSO super-packet counts as its segments)
    data_packets: int
    dropped: int

    @property
    def data_payload_bytes(self) -> int:
        """TCP payload of the data-plane class: frames minus their Ethernet/IPv4/TCP headers."""
        return self.data_bytes - TCP_FRAME_OVERHEAD_BYTES * self.data_packets


@dataclass(frozen=True)
class HostCounters:
    upload: DirectionCounters  # host -> switch
    download: DirectionCounters  # switch -> host
    iface_tx_bytes: int
    iface_rx_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def minus(self, before: HostCounters) -> HostCounters:
        """Counters accrued since `before` (for one phase of a run)."""
        def sub(a: DirectionCounters, b: DirectionCounters) -> DirectionCounters:
            return DirectionCounters(*(x - y for x, y in zip(asdict(a).values(), asdict(b).values(), strict=True)))
        return HostCounters(sub(self.upload, before.upload), sub(self.download, before.download),
                            self.iface_tx_bytes - before.iface_tx_bytes, self.iface_rx_bytes - before.iface_rx_bytes)


# Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12 (Linux default): bytes per frame not payload.
TCP_FRAME_OVERHEAD_BYTES = 66
_CLASS = re.compile(r"^class htb (\S+) .*?\brate (\d+(?:\.\d+)?)([KMG]?)bit\b")
_SENT = re.compile(r"^\s*Sent (\d+) bytes (\d+) pkt \(dropped (\d+),")
_SI = {"": 1, "K": 1_000, "M": 1_000_000, "G": 1_000_000_000}


def parse_htb_classes(text: str) -> dict[str, dict[str, int]]:
    """`tc -s class show` text -> handle -> {rate_bit_s, bytes, packets, drops}."""
    out: dict[str, dict[str, int]] = {}
    handle: str | None = None
    for line in text.splitlines():
        if m := _CLASS.match(line):
            handle = m.group(1)
            out[handle] = {"rate_bit_s": round(float(m.group(2)) * _SI[m.group(3)])}
        elif (m := _SENT.match(line)) and handle is not None:
            out[handle].update(bytes=int(m.group(1)), packets=int(m.group(2)), drops=int(m.group(3)))
            handle = None
    return out


def _classes(netns: str, dev: str) -> dict[str, dict[str, int]]:
    classes = parse_htb_classes(tc_stats(netns, "class", "show", "dev", dev))
    missing = {ROOT_CLASS, DATA_CLASS, OTHER_CLASS} - classes.keys()
    if missing or any("bytes" not in c for c in classes.values()):
        raise TestbedError(f"{netns}/{dev}: htb classes {sorted(missing)} not found; is this a swarmtrain testbed?")
    return classes


def _direction(netns: str, dev: str) -> DirectionCounters:
    c = _classes(netns, dev)
    return DirectionCounters(
        total_bytes=c[ROOT_CLASS]["bytes"], data_bytes=c[DATA_CLASS]["bytes"], other_bytes=c[OTHER_CLASS]["bytes"],
        packets=c[ROOT_CLASS]["packets"], data_packets=c[DATA_CLASS]["packets"],
        dropped=c[DATA_CLASS]["drops"] + c[OTHER_CLASS]["drops"],
    )


def _host_indices(name: str) -> list[int]:
    namespaces = find_testbeds().get(name)
    if not namespaces:
        raise TestbedError(f"no testbed named {name!r} is up (no namespaces {name}-*)")
    return sorted(int(m.group(1)) for ns in namespaces if (m := re.match(rf"^{name}-h(\d+)$", ns)))


def read_counters(name: str) -> dict[int, HostCounters]:
    """Host index -> its kernel byte counters, for testbed `name` as it exists now."""
    out: dict[int, HostCounters] = {}
    for i in _host_indices(name):
        link = ip_json(f"{name}-h{i}", "link", "show", "dev", "eth0")[0]["stats64"]
        out[i] = HostCounters(
            upload=_direction(f"{name}-h{i}", "eth0"), download=_direction(f"{name}-sw", f"h{i}"),
            iface_tx_bytes=int(link["tx"]["bytes"]), iface_rx_bytes=int(link["rx"]["bytes"]),
        )
    return out


def read_rate_bit_s(name: str, host: int) -> int:
    """The link rate host `host` is shaped to, as the kernel reports it."""
    return _classes(f"{name}-h{host}", "eth0")[ROOT_CLASS]["rate_bit_s"]


def total_wire_bytes(counters: dict[int, HostCounters], *, data_only: bool = False) -> int:
    """Bytes every host sent (uploads). Each byte crosses two shaped links, so count one end only."""
    return sum(c.upload.data_bytes if data_only else c.upload.total_bytes for c in counters.values())
