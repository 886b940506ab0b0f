"""A peer's `/metrics` in the Prometheus text format (prometheus_client), read from its Tally at scrape time.

Names follow Prometheus conventions: `swarmtrain_` prefix, base units (seconds, bytes), `_total` on
counters (prometheus_client adds it). `swarmtrain peer --metrics-port N` serves them on 127.0.0.1 (or
`--metrics-host`); the coordinator's swarm-wide metrics are in swarmtrain/dashboard/metrics.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmtrain.telemetry.tally import Histogram, Tally

__all__ = ["PeerCollector", "histogram_family", "serve_metrics"]


def histogram_family(name: str, doc: str, h: Histogram, labels: dict[str, str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets=h.cumulative(), sum_value=h.total)
    return family


class PeerCollector(Collector):
    """The metrics of one peer, labelled with its id and role (the tally's, once the peer knows them)."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.labels: dict[str, str] = {}

    def _one(self, family: CounterMetricFamily | GaugeMetricFamily, value: float) -> Metric:
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        self.labels = {"peer": self.tally.peer, "role": self.tally.role}
        s, t, keys = self.tally.stats(), self.tally, list(self.labels)
        yield self._one(CounterMetricFamily("swarmtrain_rounds_committed", "Outer rounds this peer committed.",
                                            labels=keys), s.rounds_committed)
        yield self._one(CounterMetricFamily("swarmtrain_rounds_aborted", "Outer round attempts that aborted here.",
                                            labels=keys), s.rounds_aborted)
        yield self._one(CounterMetricFamily("swarmtrain_bytes_sent", "Data-plane bytes sent by outer rounds.",
                                            labels=keys), s.bytes_sent)
        yield self._one(CounterMetricFamily("swarmtrain_bytes_received", "Data-plane bytes received by outer rounds.",
                                            labels=keys), s.bytes_received)
        yield self._one(CounterMetricFamily("swarmtrain_tokens", "Training tokens of this peer's inner steps.",
                                            labels=keys), s.tokens)
        yield self._one(CounterMetricFamily("swarmtrain_inner_steps", "Inner steps taken.", labels=keys), t.steps)
        yield self._one(CounterMetricFamily("swarmtrain_heals", "Times this peer took the swarm's state.",
                                            labels=keys), s.heals)
        yield self._one(CounterMetricFamily("swarmtrain_compute_seconds", "Seconds spent in inner steps.",
                                            labels=keys), s.compute_s)
        yield self._one(CounterMetricFamily("swarmtrain_comm_seconds", "Seconds spent averaging.", labels=keys),
                        s.comm_s)
        yield self._one(GaugeMetricFamily("swarmtrain_tokens_per_second", "Training tokens a second, last round.",
                                          labels=keys), s.tokens_per_s)
        yield self._one(GaugeMetricFamily("swarmtrain_round", "Newest outer round committed.", labels=keys), t.round)
        if s.loss is not None:
            yield self._one(GaugeMetricFamily("swarmtrain_loss", "Mean training loss of the last round.",
                                              labels=keys), s.loss)
        if s.val_loss is not None:
            yield self._one(GaugeMetricFamily("swarmtrain_val_loss", "Validation loss after the last evaluated round.",
                                              labels=keys), s.val_loss)
            yield self._one(GaugeMetricFamily("swarmtrain_val_perplexity",
                                              "exp(validation loss), last evaluated round.",
                                              labels=keys), math.exp(min(s.val_loss, 700.0)))
        if s.val_bpb is not None:
            yield self._one(GaugeMetricFamily("swarmtrain_val_bits_per_byte",
                                              "Validation loss in bits per byte of text, last evaluated round.",
                                              labels=keys), s.val_bpb)
        if s.spread is not None:
            yield self._one(GaugeMetricFamily("swarmtrain_gossip_spread",
                                              "Gossip: relative L2 distance of φ to its partners', "
                                              "last round with one.",
                                              labels=keys), s.spread)
        yield histogram_family("swarmtrain_allreduce_seconds", "Seconds of each outer round's averaging.",
                               t.allreduce_s, self.labels)
        yield histogram_family("swarmtrain_inner_step_seconds", "Seconds of each inner step (a round's mean).",
                               t.inner_step_s, self.labels)


def serve_metrics(tally: Tally, *, port: int, host: str) -> int:
    """Serve `tally` as `/metrics` on host:port (0 = any free port) from a daemon thread; returns the port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PeerCollector(tally))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
