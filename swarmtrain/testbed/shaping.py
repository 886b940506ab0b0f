"""Link shaping as `tc` argument lists: rate parsing, the htb tree with per-port accounting, netem."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DATA_CLASS",
    "OTHER_CLASS",
    "ROOT_CLASS",
    "LinkSpec",
    "TestbedError",
    "bulk_port_of",
    "netem_args",
    "parse_rate",
    "shaping_commands",
]

BULK_PORT_OFFSET = 10  # past the testbed's DHT ports (data_port + 1 and + 2)
# htb class ids under root handle 1: (the tree is the same on every shaped device)
ROOT_CLASS = "1:1"  # the link: all traffic, shaped to the link rate
DATA_CLASS = "1:10"  # TCP to/from the data-plane port: what swarmtrain itself counts
OTHER_CLASS = "1:20"  # everything else (DHT, ACKs of other flows, gloo, ARP...)

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
_ETH_HEADER_BYTES = 14
_MAX_GSO_BYTES = 65_536 + _ETH_HEADER_BYTES


class TestbedError(ValueError):
    """The testbed cannot be built, found, used or removed; the message says what and why."""

    __test__ = False  # not a pytest test class despite the name


def parse_rate(text: str) -> int:
    """`100mbit` -> 100_000_000 bits/s. Only bit units (tc's `bps` means *bytes* and is refused)."""
    m = _RATE.match(text.strip().lower())
    if not m:
        raise TestbedError(f"rate {text!r}: expected a number and one of bit, kbit, mbit, gbit (e.g. 100mbit)")
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not 8_000 <= bits <= 100_000_000_000:
        raise TestbedError(f"rate {text!r}: must be between 8kbit and 100gbit")
    return bits


@dataclass(frozen=True)
class LinkSpec:
    """One host's access link, applied to the egress of both ends of its veth (upload and download).

    `delay_ms` and `loss_pct` are per direction on each end: host-to-host one-way delay is
    2 x delay_ms (sender's uplink + receiver's downlink). They need the kernel's netem qdisc.
    """

    rate_bit_s: int
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    mtu: int = 1500

    def __post_init__(self) -> None:
        if self.rate_bit_s < 8_000:
            raise TestbedError(f"rate_bit_s={self.rate_bit_s}: must be >= 8000")
        if not 0 <= self.delay_ms <= 10_000:
            raise TestbedError(f"delay_ms={self.delay_ms}: must be in [0, 10000]")
        if not 0 <= self.loss_pct < 100:
            raise TestbedError(f"loss_pct={self.loss_pct}: must be in [0, 100)")
        if not 576 <= self.mtu <= 9000:
            raise TestbedError(f"mtu={self.mtu}: must be in [576, 9000]")

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.loss_pct > 0

    @property
    def rate_bytes_s(self) -> float:
        return self.rate_bit_s / 8


def netem_args(link: LinkSpec) -> list[str]:
    """The netem options for `link` (empty when it needs no netem)."""
    args: list[str] = []
    if link.delay_ms > 0:
        args += ["delay", f"{link.delay_ms:g}ms"]
    if link.loss_pct > 0:
        args += ["loss", f"{link.loss_pct:g}%"]
    return args


def _queue_limit_bytes(link: LinkSpec) -> int:
    # ~200 ms of line rate (a home router's buffer), never less than four GSO super-packets
    # (veth passes 64 KiB skbs): shallow buffers drop bursts, and retransmits blur byte accounting.
    return max(int(link.rate_bytes_s * 0.2), 4 * _MAX_GSO_BYTES)


def shaping_commands(dev: str, link: LinkSpec, *, data_port: int) -> list[list[str]]:
    """`tc` argument lists (without the leading `tc -n NS`) that shape `dev`'s egress.

    An htb tree: the root class holds the link rate; two children share it (each may borrow
    the whole rate), one for TCP to/from the data plane (`data_port`, the gRPC port, and
    `bulk_port_of(data_port)`, the bulk port peers use on a testbed) and one for
    everything else, so the kernel's per-class byte counters separate data-plane bytes from
    control-plane bytes.
    """
    if not 1 <= data_port <= 65535 - BULK_PORT_OFFSET:
        raise TestbedError(f"data_port={data_port}: must be in [1, {65535 - BULK_PORT_OFFSET}] "
                           f"(the bulk port is data_port + {BULK_PORT_OFFSET})")
    rate = f"{link.rate_bit_s}bit"
    half = f"{max(link.rate_bit_s // 2, 8_000)}bit"
    # One GSO super-packet per round keeps the borrow accounting honest at any rate.
    common = ["quantum", str(_MAX_GSO_BYTES), "burst", str(_MAX_GSO_BYTES), "cburst", str(_MAX_GSO_BYTES)]
    cmds: list[list[str]] = [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", ROOT_CLASS, "htb", "rate", rate, "ceil", rate, *common],
        ["class", "add", "dev", dev, "parent", ROOT_CLASS, "classid", DATA_CLASS, "htb", "rate", half, "ceil", rate,
         *common],
        ["class", "add", "dev", dev, "parent", ROOT_CLASS, "classid", OTHER_CLASS, "htb", "rate", half, "ceil", rate,
         *common],
    ]
    for handle, parent in (("10:", DATA_CLASS), ("20:", OTHER_CLASS)):
        if link.needs_netem:
            cmds.append(["qdisc", "add", "dev", dev, "parent", parent, "handle", handle, "netem", *netem_args(link),
                         "limit", "10000"])
        else:
            cmds.append(["qdisc", "add", "dev", dev, "parent", parent, "handle", handle, "bfifo",
                         "limit", str(_queue_limit_bytes(link))])
    for port in (data_port, bulk_port_of(data_port)):
        for direction in ("sport", "dport"):
            cmds.append(["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "protocol", "6", "0xff", "match", "ip", direction, str(port), "0xffff",
                         "flowid", DATA_CLASS])
    return cmds


def bulk_port_of(data_port: int) -> int:
    """The all-reduce bulk port (`rpc.bulk_port`) of a testbed peer whose gRPC port is `data_port`."""
    return data_port + BULK_PORT_OFFSET
