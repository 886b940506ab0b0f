"""Link rates from sampled counters: the /proc/net/dev parser and the peak over sliding spans."""

from __future__ import annotations

import pytest

from swarmtrain.testbed.rates import LinkRateSampler, RateSeries, parse_net_dev, peak_rate_bit_s
from swarmtrain.testbed.shaping import TestbedError

pytestmark = pytest.mark.unit

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     840      12    0    0    0     0          0         0      840      12    0    0    0     0       0          0
  eth0: 1234567    890    0    0    0     0          0         0  7654321     432    0    0    0     0       0          0
"""  # noqa: E501


def test_parse_net_dev_reads_rx_and_tx_bytes_of_the_device() -> None:
    assert parse_net_dev(NET_DEV, "eth0") == (1234567, 7654321)
    assert parse_net_dev(NET_DEV, "lo") == (840, 840)


def test_parse_net_dev_names_a_missing_device_or_a_short_line() -> None:
    with pytest.raises(TestbedError, match="no interface 'eth1'"):
        parse_net_dev(NET_DEV, "eth1")
    with pytest.raises(TestbedError, match="3 fields"):
        parse_net_dev("eth0: 1 2 3\n", "eth0")


def test_a_steady_rate_is_its_own_peak() -> None:
    t = [0.1 * i for i in range(101)]
    counts = [round(1_250_000 * x) for x in t]  # 10 Mbit/s
    assert peak_rate_bit_s(t, counts, window_s=1.0) == pytest.approx(10e6, rel=1e-3)


def test_a_burst_shorter_than_the_window_is_spread_over_it() -> None:
    # 1 MB sent between 5.0 and 5.2 s, nothing else: 40 Mbit/s over 0.2 s, 8 Mbit/s over 1 s, 4 over 2 s
    t = [0.1 * i for i in range(101)]
    counts = [0 if x < 5.0 - 1e-9 else (1_000_000 if x > 5.2 - 1e-9 else round(5_000_000 * (x - 5.0))) for x in t]
    assert peak_rate_bit_s(t, counts, window_s=0.2) == pytest.approx(40e6, rel=1e-6)
    assert peak_rate_bit_s(t, counts, window_s=1.0) == pytest.approx(8e6, rel=1e-6)
    assert peak_rate_bit_s(t, counts, window_s=2.0) == pytest.approx(4e6, rel=1e-6)


def test_uneven_sampling_divides_by_the_real_span() -> None:
    # a late sample: 2.5 MB over the 1.25 s from 0.0 to 1.25 is 16 Mbit/s, not 20
    assert peak_rate_bit_s([0.0, 0.5, 1.25], [0, 0, 2_500_000], window_s=1.0) == pytest.approx(16e6)


def test_no_span_as_long_as_the_window_gives_zero_and_bad_arguments_are_refused() -> None:
    assert peak_rate_bit_s([0.0, 0.5], [0, 100], window_s=1.0) == 0.0
    assert peak_rate_bit_s([], [], window_s=1.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        peak_rate_bit_s([0.0], [0], window_s=0)
    with pytest.raises(ValueError, match="2 times for 1"):
        peak_rate_bit_s([0.0, 1.0], [0], window_s=1.0)


def test_series_peaks_by_direction() -> None:
    s = RateSeries("x-h0", (0.0, 1.0, 2.0), rx_bytes=(0, 125_000, 250_000), tx_bytes=(0, 0, 1_250_000))
    assert s.peak_bit_s(window_s=1.0) == {"upload": pytest.approx(10e6), "download": pytest.approx(1e6)}


def test_sampler_refuses_bad_arguments_and_names_a_missing_namespace() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LinkRateSampler(["x"], interval_s=0)
    with pytest.raises(ValueError, match="no namespaces"):
        LinkRateSampler([])
    with pytest.raises(TestbedError, match="swarmtrain-no-such-ns"), LinkRateSampler(["swarmtrain-no-such-ns"]):
        pass


def test_a_sampler_that_takes_no_first_sample_in_time_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def stuck(self: LinkRateSampler) -> None:  # a sampling thread that never gets its first sample
        self._stop.wait(10.0)

    monkeypatch.setattr(LinkRateSampler, "_run", stuck)
    with pytest.raises(TestbedError, match=r"no sample of \['x-h0'\] within 0.05 s"), \
            LinkRateSampler(["x-h0"], start_timeout_s=0.05):
        pass
