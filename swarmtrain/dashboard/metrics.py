"""The coordinator's `/metrics`: swarm-wide Prometheus metrics, read from the Collector at scrape time."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from swarmtrain.dashboard.collector import Collector
from swarmtrain.telemetry.prometheus import histogram_family

__all__ = ["SwarmCollector", "render"]


class SwarmCollector(PromCollector):
    def __init__(self, collector: Collector) -> None:
        self.c = collector

    def collect(self) -> Iterator[Metric]:
        c, totals, status = self.c, self.c.history.totals(), self.c.status()
        live = GaugeMetricFamily("swarmtrain_live_peers", "Peers with a live record (invalid ones included).",
                                 labels=["role"])
        roles: dict[str, int] = {}
        for p in status["peers"]:
            roles[p["role"]] = roles.get(p["role"], 0) + 1
        for role, n in sorted(roles.items()):
            live.add_metric([role], n)
        yield live
        yield GaugeMetricFamily("swarmtrain_invalid_peers", "Live peers whose record carries absurd values.",
                                value=status["invalid_peers"])
        yield GaugeMetricFamily("swarmtrain_hash_agreement",
                                "Fraction of valid live peers at their part's newest round holding its majority hash.",
                                value=status["hash_agreement"])
        yield GaugeMetricFamily("swarmtrain_swarm_round", "Newest round any valid live peer reached.",
                                value=status["round"])
        yield GaugeMetricFamily("swarmtrain_alerts", "Alerts the dashboard shows now.", value=len(status["alerts"]))
        yield CounterMetricFamily("swarmtrain_swarm_rounds_sampled", "Peer rounds the coordinator recorded.",
                                  value=totals["samples"])
        yield CounterMetricFamily("swarmtrain_swarm_rounds_aborted", "Aborted round attempts peers reported.",
                                  value=totals["aborts"])
        yield CounterMetricFamily("swarmtrain_swarm_tokens", "Training tokens of the recorded peer rounds.",
                                  value=totals["tokens"])
        yield CounterMetricFamily("swarmtrain_swarm_bytes", "Data-plane bytes of the recorded peer rounds.",
                                  value=totals["bytes"])
        yield GaugeMetricFamily("swarmtrain_swarm_tokens_per_second", "Sum of the valid live peers' tokens/s.",
                                value=sum((p["stats"] or {}).get("tokens_per_s", 0.0) for p in status["peers"]
                                          if p["state"] != "invalid"))
        valid = [p for p in status["peers"] if p["state"] != "invalid"
                 and (p["stats"] or {}).get("val_loss") is not None]
        newest = max(valid, key=lambda p: p["round"], default=None)
        if newest is not None:  # the most advanced peer's last evaluation of θ_global
            stats = newest["stats"]
            yield GaugeMetricFamily("swarmtrain_swarm_val_loss", "Validation loss of the newest evaluated θ_global.",
                                    value=stats["val_loss"])
            yield GaugeMetricFamily("swarmtrain_swarm_val_perplexity", "exp(swarmtrain_swarm_val_loss).",
                                    value=math.exp(min(stats["val_loss"], 700.0)))
            if stats.get("val_bpb") is not None:
                yield GaugeMetricFamily("swarmtrain_swarm_val_bits_per_byte",
                                        "That validation loss in bits per byte of text.", value=stats["val_bpb"])
        spreads = [p["stats"]["spread"] for p in status["peers"] if p["state"] != "invalid"
                   and (p["stats"] or {}).get("spread") is not None]
        if spreads:  # gossip: how far apart the live replicas are, as they report it
            yield GaugeMetricFamily("swarmtrain_swarm_gossip_spread", "Mean over live peers of their last gossip "
                                    "round's relative L2 distance to their partners.",
                                    value=sum(spreads) / len(spreads))
        yield CounterMetricFamily("swarmtrain_dashboard_poll_errors", "Reads of the live peers that failed.",
                                  value=c.poll_errors)
        yield histogram_family("swarmtrain_allreduce_seconds", "Averaging seconds of each recorded peer round.",
                               c.allreduce_s, {})


def render(collector: Collector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(collector))
    return generate_latest(registry)
