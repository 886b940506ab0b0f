"""The dashboard's HTTP server (aiohttp): the page, a read-only JSON API and the swarm's /metrics.

aiohttp because the coordinator is an asyncio program already: the server runs on its event loop next
to the DHT node, with no second framework, thread or process; it is well kept and serves static files
and JSON without extra packages. Every route is a GET and reads the Collector; nothing here writes to
the DHT.

    /                      the page (static/index.html; its script polls the API)
    /api/health            is the collector polling, since when, how often it failed
    /api/status            round, hash agreement, alerts and the live peers
    /api/peers             the live peers
    /api/rounds?since=R&limit=N   the rounds timeline from round R (N rows at most, 1..10000)
    /metrics               Prometheus text format
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from swarmtrain.dashboard.collector import Collector
from swarmtrain.dashboard.metrics import render

__all__ = ["MAX_ROUNDS_LIMIT", "Dashboard", "QueryError", "int_param"]

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
MAX_ROUNDS_LIMIT = 10000


class QueryError(ValueError):
    """A malformed query parameter: answered 400 with this message."""


def int_param(query: Any, name: str, *, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(f"{name}={raw[:40]!r} is not an integer") from None
    if not lo <= value <= hi:
        raise QueryError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


class Dashboard:
    """Serves `collector` on host:port (0 = any free port) and polls it every `poll_s` until closed."""

    def __init__(self, collector: Collector, *, host: str, port: int, poll_s: float) -> None:
        self.collector = collector
        self.host, self.port, self.poll_s = host, port, poll_s
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task[None] | None = None
        app = web.Application(middlewares=[_errors])
        app.add_routes([web.get("/", self._page), web.get("/api/health", self._health),
                        web.get("/api/status", self._status), web.get("/api/peers", self._peers),
                        web.get("/api/rounds", self._rounds), web.get("/metrics", self._metrics),
                        web.static("/static", STATIC, show_index=False, follow_symlinks=False)])
        self.app = app

    async def start(self) -> int:
        """Poll once, then listen; returns the bound port."""
        await self.collector.poll()
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the bound port (port 0: the one the OS chose)
        self._poller = asyncio.create_task(self._poll())
        log.info("dashboard on http://%s:%d/", self.host, self.port)
        return self.port

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._runner is not None:
            await self._runner.cleanup()
        self.collector.history.close()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.collector.poll()

    # -- routes ---------------------------------------------------------------------------------------
    async def _page(self, _: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _health(self, _: web.Request) -> web.Response:
        c = self.collector
        age = time.time() - c.last_poll_at if c.last_poll_at else None
        return web.json_response({"ok": c.polls > 0 and (age is None or age < 10 * self.poll_s + 30),
                                  "run_id": c.discovery.run_id, "coordinator": c.discovery.peer_id,
                                  "uptime_s": round(time.time() - c.started_at, 1), "polls": c.polls,
                                  "poll_errors": c.poll_errors, "last_poll_age_s": age, "db": c.history.path})

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self.collector.status())

    async def _peers(self, _: web.Request) -> web.Response:
        return web.json_response(self.collector.peers())

    async def _rounds(self, request: web.Request) -> web.Response:
        since = int_param(request.query, "since", default=0, lo=0, hi=2**62)
        limit = int_param(request.query, "limit", default=1000, lo=1, hi=MAX_ROUNDS_LIMIT)
        return web.Response(text=self.collector.history.rounds_json(since=since, limit=limit),
                            content_type="application/json")

    async def _metrics(self, _: web.Request) -> web.Response:
        resp = web.Response(body=render(self.collector))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except QueryError as e:
        return web.json_response({"error": str(e)}, status=400)
