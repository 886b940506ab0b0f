"""Link rates over time: each host's interface byte counters, sampled from inside its namespace.

`counters.py` reads totals once per phase; a rate over time needs samples every few tens of
milliseconds, and spawning `tc` or `ip` that often would take CPU from the peers being measured. So
one thread enters each host's network namespace in turn (`setns` moves only the calling thread) and
reads `/proc/thread-self/net/dev`. These are the veth's own counters (a GSO packet counts once, with
one set of headers), a little below what the htb classes count, and they include every port.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from swarmtrain.testbed.shaping import TestbedError

__all__ = ["LinkRateSampler", "RateSeries", "parse_net_dev", "peak_rate_bit_s"]

_CLONE_NEWNET = 0x40000000


def parse_net_dev(text: str, dev: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of `dev` in a /proc/net/dev listing; TestbedError if it is not listed."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == dev:
            fields = rest.split()
            if len(fields) < 9:
                raise TestbedError(f"/proc/net/dev: the line of {dev} has {len(fields)} fields, expected 16")
            return int(fields[0]), int(fields[8])
    raise TestbedError(f"/proc/net/dev lists no interface {dev!r}")


def peak_rate_bit_s(t_s: Sequence[float], total_bytes: Sequence[int], *, window_s: float) -> float:
    """The highest rate over any span of at least `window_s` between two samples, in bit/s.

    From each sample, the span runs to the first later sample at least `window_s` away, so every
    span is as short as the sampling allows: a burst shorter than the window is spread over it.
    0.0 when no two samples are that far apart.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if len(t_s) != len(total_bytes):
        raise ValueError(f"{len(t_s)} times for {len(total_bytes)} counter samples")
    peak, j = 0.0, 0
    for i in range(len(t_s)):
        j = max(j, i + 1)
        while j < len(t_s) and t_s[j] - t_s[i] < window_s:
            j += 1
        if j == len(t_s):
            break
        peak = max(peak, 8 * (total_bytes[j] - total_bytes[i]) / (t_s[j] - t_s[i]))
    return peak


@dataclass(frozen=True)
class RateSeries:
    """One host's interface counters over time (seconds from the sampler's start)."""

    netns: str
    t_s: tuple[float, ...]
    rx_bytes: tuple[int, ...]  # download
    tx_bytes: tuple[int, ...]  # upload

    def peak_bit_s(self, *, window_s: float) -> dict[str, float]:
        return {"upload": peak_rate_bit_s(self.t_s, self.tx_bytes, window_s=window_s),
                "download": peak_rate_bit_s(self.t_s, self.rx_bytes, window_s=window_s)}


class LinkRateSampler:
    """Samples `dev`'s counters in each namespace every `interval_s` until closed (a context manager)."""

    def __init__(self, namespaces: Sequence[str], *, dev: str = "eth0", interval_s: float = 0.05,
                 start_timeout_s: float = 10.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not namespaces:
            raise ValueError("LinkRateSampler: no namespaces to sample")
        self.namespaces = tuple(namespaces)
        self.dev = dev
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self._samples: dict[str, list[tuple[float, int, int]]] = {ns: [] for ns in self.namespaces}
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="link-rate-sampler", daemon=True)

    def __enter__(self) -> LinkRateSampler:
        self._thread.start()
        started = self._started.wait(timeout=self.start_timeout_s)
        self._raise_error()
        if not started:
            self.close()
            raise TestbedError(f"link rate sampler: no sample of {list(self.namespaces)} within "
                               f"{self.start_timeout_s:g} s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._raise_error()

    def series(self) -> list[RateSeries]:
        return [RateSeries(ns, tuple(t for t, _, _ in s), tuple(rx for _, rx, _ in s), tuple(tx for _, _, tx in s))
                for ns, s in self._samples.items()]

    def peak_bit_s(self, *, window_s: float) -> dict[str, float]:
        """The highest upload and download rate of any host over spans of `window_s`."""
        peaks = [s.peak_bit_s(window_s=window_s) for s in self.series()]
        return {d: max((p[d] for p in peaks), default=0.0) for d in ("upload", "download")}

    def _raise_error(self) -> None:
        if self._error is not None:
            raise TestbedError(f"link rate sampler: {self._error}") from self._error

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fds: dict[str, int] = {}
        own = -1
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            for ns in self.namespaces:
                fds[ns] = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            start = time.monotonic()
            while True:
                stopping = self._stop.is_set()  # one more sample after close(): the counters at the end
                for ns, fd in fds.items():
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
                    with open("/proc/thread-self/net/dev") as f:
                        rx, tx = parse_net_dev(f.read(), self.dev)
                    self._samples[ns].append((time.monotonic() - start, rx, tx))
                self._started.set()
                if stopping:
                    return
                self._stop.wait(self.interval_s)
        except BaseException as e:  # reported to the caller by __enter__/close
            self._error = e
            self._started.set()
        finally:
            if own >= 0:
                libc.setns(own, _CLONE_NEWNET)
                os.close(own)
            for fd in fds.values():
                os.close(fd)
