"""The coordinator's dashboard: who is in the swarm, which round, whether every peer holds the same weights.

validate.py   which peer records are absurd (listed as invalid, never charted)
history.py    History: SQLite (peers, one sample per peer and round, aborts, totals), bounded retention
collector.py  Collector: reads the live records every poll, samples new rounds, status and alerts
metrics.py    the swarm's /metrics (Prometheus text format)
app.py        Dashboard: aiohttp server for the page (static/), the JSON API and /metrics; read-only
"""

from swarmtrain.dashboard.app import Dashboard
from swarmtrain.dashboard.collector import Collector
from swarmtrain.dashboard.history import History

__all__ = ["Collector", "Dashboard", "History"]
