"""The namespace twin's pure parts: rates, the tc command tree, counter parsing, the CLI surface."""

from __future__ import annotations

import pytest

from swarmtrain.daemon.cli import build_parser
from swarmtrain.testbed import LinkSpec, TestbedError, parse_rate
from swarmtrain.testbed.counters import TCP_FRAME_OVERHEAD_BYTES, DirectionCounters, parse_htb_classes
from swarmtrain.testbed.netns import Testbed
from swarmtrain.testbed.shaping import DATA_CLASS, OTHER_CLASS, ROOT_CLASS, netem_args, shaping_commands

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "bits"), [("100mbit", 100_000_000), ("20mbit", 20_000_000),
                                            ("1.5gbit", 1_500_000_000), ("512kbit", 512_000), ("8000bit", 8000)])
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["100", "100mbps", "100MB", "fast", "-5mbit", "1kbit", "200gbit"])
def test_parse_rate_rejects_bad_units_and_ranges(text: str) -> None:
    with pytest.raises(TestbedError, match="rate"):
        parse_rate(text)


def test_link_spec_validates_each_field() -> None:
    for kwargs, field in [({"delay_ms": -1}, "delay_ms"), ({"loss_pct": 100}, "loss_pct"), ({"mtu": 100}, "mtu")]:
        with pytest.raises(TestbedError, match=field):
            LinkSpec(rate_bit_s=1_000_000, **kwargs)


def test_shaping_tree_counts_the_data_port_separately() -> None:
    cmds = [" ".join(c) for c in shaping_commands("eth0", LinkSpec(rate_bit_s=20_000_000), data_port=7000)]
    assert cmds[0] == "qdisc add dev eth0 root handle 1: htb default 20"
    assert any(f"classid {ROOT_CLASS} htb rate 20000000bit ceil 20000000bit" in c for c in cmds)
    for cls in (DATA_CLASS, OTHER_CLASS):  # both children may borrow the whole link
        assert any(f"parent {ROOT_CLASS} classid {cls} htb rate 10000000bit ceil 20000000bit" in c for c in cmds)
    filters = [c for c in cmds if c.startswith("filter")]
    assert len(filters) == 4 and all(f"0xffff flowid {DATA_CLASS}" in f for f in filters)
    for port in (7000, 7010):  # the gRPC port and the all-reduce bulk port
        for direction in ("sport", "dport"):
            assert any(f"match ip protocol 6 0xff match ip {direction} {port} 0xffff" in f for f in filters)
    assert not any("netem" in c for c in cmds)


def test_netem_leaves_only_when_asked() -> None:
    link = LinkSpec(rate_bit_s=20_000_000, delay_ms=40, loss_pct=0.5)
    assert netem_args(link) == ["delay", "40ms", "loss", "0.5%"]
    leaves = [c for c in shaping_commands("h0", link, data_port=7000) if "netem" in c]
    assert len(leaves) == 2 and all(c[c.index("netem") + 1:][:4] == ["delay", "40ms", "loss", "0.5%"] for c in leaves)
    assert netem_args(LinkSpec(rate_bit_s=20_000_000)) == []


def test_bad_data_port_is_refused() -> None:
    with pytest.raises(TestbedError, match="data_port"):
        shaping_commands("eth0", LinkSpec(rate_bit_s=1_000_000), data_port=0)
    with pytest.raises(TestbedError, match="bulk port"):
        shaping_commands("eth0", LinkSpec(rate_bit_s=1_000_000), data_port=65535)


TC_CLASS_TEXT = """\
class htb 1:10 parent 1:1 leaf 10: prio 0 rate 10Mbit ceil 20Mbit burst 64Kb cburst 64Kb
 Sent 5228170 bytes 3457 pkt (dropped 0, overlimits 120 requeues 0)
 backlog 0b 0p requeues 0
 lended: 0 borrowed: 0 giants: 0
 tokens: 819375 ctokens: 409687

class htb 1:1 root rate 20Mbit ceil 20Mbit burst 64Kb cburst 64Kb
 Sent 5250000 bytes 3500 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0

class htb 1:20 parent 1:1 leaf 20: prio 0 rate 800Kbit ceil 20Mbit burst 64Kb cburst 64Kb
 Sent 21830 bytes 43 pkt (dropped 2, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_parse_htb_classes_from_tc_text() -> None:
    classes = parse_htb_classes(TC_CLASS_TEXT)
    assert classes[ROOT_CLASS] == {"rate_bit_s": 20_000_000, "bytes": 5_250_000, "packets": 3500, "drops": 0}
    assert classes[DATA_CLASS]["bytes"] == 5_228_170
    assert classes[OTHER_CLASS] == {"rate_bit_s": 800_000, "bytes": 21_830, "packets": 43, "drops": 2}


def test_data_payload_removes_per_frame_headers() -> None:
    # Measured on this testbed: 5,000,000 bytes of TCP payload became 3457 frames / 5,228,170 bytes.
    c = DirectionCounters(total_bytes=5_250_000, data_bytes=5_228_170, other_bytes=21_830, packets=3500,
                          data_packets=3457, dropped=0)
    assert TCP_FRAME_OVERHEAD_BYTES == 66
    assert abs(c.data_payload_bytes - 5_000_000) < 100


def test_testbed_names_and_addresses_are_derived_from_the_name() -> None:
    tb = Testbed("ci1", num_hosts=3, link=LinkSpec(rate_bit_s=1_000_000))
    assert tb.switch_ns == "ci1-sw"
    assert [(h.netns, h.ip, h.switch_port) for h in tb.hosts] == [
        ("ci1-h0", "10.77.0.10", "h0"), ("ci1-h1", "10.77.0.11", "h1"), ("ci1-h2", "10.77.0.12", "h2")]
    for bad in ("", "Swt", "1abc", "toolongname", "a-b"):
        with pytest.raises(TestbedError, match="testbed name"):
            Testbed(bad, num_hosts=1, link=LinkSpec(rate_bit_s=1_000_000))
    with pytest.raises(TestbedError, match="num_hosts"):
        Testbed("ci1", num_hosts=0, link=LinkSpec(rate_bit_s=1_000_000))
    with pytest.raises(TestbedError, match="delay_by='kernel'"):
        Testbed("ci1", num_hosts=2, link=LinkSpec(rate_bit_s=1_000_000), delay_by="kernel")


def test_cli_surface() -> None:
    parser = build_parser()
    up = parser.parse_args(["testbed", "up", "--hosts", "4", "--rate", "20mbit", "--delay-ms", "10"])
    assert (up.action, up.hosts, up.rate, up.delay_ms, up.loss_pct, up.name, up.data_port) == (
        "up", 4, "20mbit", 10.0, 0.0, "swt", 7000)
    assert up.cpus is None and up.delay_by == "auto"
    assert parser.parse_args(["testbed", "up", "--hosts", "2", "--delay-ms", "25", "--delay-by", "forwarder"]
                             ).delay_by == "forwarder"
    with pytest.raises(SystemExit):
        parser.parse_args(["testbed", "up", "--hosts", "2", "--delay-by", "tc"])
    assert parser.parse_args(["testbed", "up", "--hosts", "2", "--cpus", "0.25"]).cpus == 0.25
    run = parser.parse_args(["testbed", "run", "--host", "1", "--", "swarmtrain", "peer", "--host", "{ip}"])
    assert run.cmd == ["--", "swarmtrain", "peer", "--host", "{ip}"]
    assert parser.parse_args(["testbed", "down", "--all"]).all
    with pytest.raises(SystemExit):
        parser.parse_args(["testbed", "down", "--all", "--name", "x"])
