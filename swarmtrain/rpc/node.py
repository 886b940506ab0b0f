"""One peer's gRPC runtime: the grpc.aio server and channels on one event loop, call auth, byte counters."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import uvloop
from grpc import aio

from swarmtrain.config import RpcConfig
from swarmtrain.rpc import bulk
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.bulk import BULK_HELLO_TIMEOUT_S, BulkServer
from swarmtrain.rpc.errors import Rejected, RpcError, RpcRejected, RpcTimeout, RpcUnavailable, status_name
from swarmtrain.rpc.tls import NodeTls
from swarmtrain.trust import CallAuth, CallRefused, CallSigner, RunSecret, resolve_run_key
from swarmtrain.trust.calls import AUTH_HEADER, PEER_HEADER

__all__ = [
    "ByteCounters",
    "Rejected",
    "RpcError",
    "RpcNode",
    "RpcRejected",
    "RpcTimeout",
    "RpcUnavailable",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LOGGED_REFUSALS = 1024  # callers counted one by one for the log; the rest share one count


def status_of(rejected: Rejected) -> grpc.StatusCode:
    return grpc.StatusCode[status_name(rejected)]


def translate(err: aio.AioRpcError) -> RpcError:
    """A grpc error as one of our typed errors (callers never see grpc types)."""
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return RpcUnavailable(f"{code.name}: {err.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RpcTimeout(f"{code.name}: {err.details()}")
    return RpcRejected(code.name, err.details() or "")


RECONNECT_BACKOFF_MIN_MS = 100
RECONNECT_BACKOFF_MAX_MS = 1000  # a channel to a down peer tries to connect at least once a second


class ByteCounters:
    """Payload bytes sent to / received from each peer (thread-safe; read by telemetry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[str, int] = {}
        self._received: dict[str, int] = {}

    def add_sent(self, peer: str, size_bytes: int) -> None:
        with self._lock:
            self._sent[peer] = self._sent.get(peer, 0) + size_bytes

    def add_received(self, peer: str, size_bytes: int) -> None:
        with self._lock:
            self._received[peer] = self._received.get(peer, 0) + size_bytes

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received) over all peers since start."""
        with self._lock:
            return sum(self._sent.values()), sum(self._received.values())

    def per_peer(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            peers = set(self._sent) | set(self._received)
            return {p: (self._sent.get(p, 0), self._received.get(p, 0)) for p in sorted(peers)}


class _CallAuthInterceptor(aio.ServerInterceptor):
    """Refuses every call without a valid, fresh proof of the run key for this node (trust/calls.py).
    A refused caller is logged at its 1st, 10th, 100th… refusal, so junk cannot flood the log."""

    def __init__(self, auth: CallAuth, *, callee: Callable[[], str]) -> None:
        self._auth = auth
        self._callee = callee
        self._refusals: dict[str, int] = {}

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        meta = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
        caller = meta.get(PEER_HEADER, "")
        handler = await continuation(details)
        if handler is None:
            return handler
        try:
            self._auth.check(method=details.method, caller=caller, callee=self._callee(),
                             header=meta.get(AUTH_HEADER, ""), now=time.time())
        except CallRefused as e:
            self._log_refusal(details.method, caller, str(e))
            return _denying(handler, str(e))
        return handler

    def _log_refusal(self, method: str, caller: str, why: str) -> None:
        who = caller[:128] if caller[:128] in self._refusals or len(self._refusals) < MAX_LOGGED_REFUSALS \
            else "(callers past the first 1024)"
        n = self._refusals[who] = self._refusals.get(who, 0) + 1
        if str(n).rstrip("0") == "1":
            log.warning("refused %s from %r (%d so far): %s", method, who, n, why)


def _denying(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def deny(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def deny_stream(_request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - abort raises

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


@dataclass(frozen=True)
class _Loop:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    stop: asyncio.Event | None  # set to end the node's own loop thread; None: the node runs on its opener's loop


class RpcNode:
    """A peer's data-plane runtime. Register services with `add_service` before it starts.

    `await open()` runs the node on the caller's event loop: a peer process's one loop serves its calls,
    its matchmaking and its heartbeat, and compute goes to threads. `start()` runs it on a uvloop thread of
    its own instead, for synchronous callers (tests, benchmarks, the blocking facades). Either way `call(coro)`
    awaits work on the node's loop from any loop, and `run(coro)` blocks for it from a thread other than the
    node's. `serve=False` is client mode: no server, outbound calls only.
    """

    def __init__(self, cfg: RpcConfig, *, peer_id: str, serve: bool = True) -> None:
        self.cfg = cfg
        self.peer_id = peer_id
        self.serve = serve
        self.counters = ByteCounters()
        # receive and scratch buffers of the data plane, reused across rounds (loop thread only)
        self.buffers = BufferPool(max_bytes=cfg.buffer_pool_mib << 20)
        self.secret = RunSecret.from_run_key(resolve_run_key(cfg.run_key))
        self._signer = CallSigner(self.secret, peer_id=peer_id)
        self.tls = NodeTls(self.secret, peer_id=peer_id) if cfg.tls else None  # TlsWithoutKeyError on an open run
        self._registrations: list[Callable[[aio.Server], None]] = []
        self._channels: dict[str, aio.Channel] = {}
        self._server: aio.Server | None = None
        self.bulk: BulkServer | None = None  # the bulk port (rpc/bulk.py) when serving with bulk_transport "tcp"
        self._loop: _Loop | None = None
        self._endpoint = ""
        self.options = [("grpc.max_send_message_length", cfg.max_message_bytes),
                        ("grpc.max_receive_message_length", cfg.max_message_bytes),
                        ("grpc.so_reuseport", 0),
                        # A peer that died and came back at its address must be reachable at once: gRPC's default
                        # reconnect backoff grows to 120 s while the peer is down, and a cached channel fails every
                        # call fast (UNAVAILABLE) until its next try, so a restarted reducer missed whole rounds.
                        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MIN_MS),
                        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MIN_MS),
                        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)]

    # -- lifecycle -------------------------------------------------------------------------
    def add_service(self, register: Callable[[aio.Server], None]) -> None:
        """`register(server)` adds a servicer (e.g. `add_AveragingServicer_to_server`) at start."""
        if self._loop is not None:
            raise RuntimeError("RpcNode.add_service: the node already started")
        self._registrations.append(register)

    async def open(self) -> str:
        """Start on the running event loop (the server too unless client mode); returns the endpoint or ''."""
        if self._loop is not None:
            raise RuntimeError("RpcNode.open: already started")
        self._loop = _Loop(asyncio.get_running_loop(), threading.current_thread(), None)
        if self.serve:
            try:
                self._endpoint = await self._start_server()
            except BaseException:
                self._loop = None
                await self._shutdown()
                raise
        return self._endpoint

    def start(self, *, timeout_s: float = 10.0) -> str:
        """Start a loop thread of its own (and the server unless client mode); returns the endpoint or ''."""
        if self._loop is not None:
            raise RuntimeError("RpcNode.start: already started")
        ready: concurrent.futures.Future[_Loop] = concurrent.futures.Future()
        thread = threading.Thread(target=self._thread_main, args=(ready,), name=f"rpc-{self.peer_id}", daemon=True)
        thread.start()
        self._loop = ready.result(timeout=timeout_s)
        if self.serve:
            self._endpoint = self.run(self._start_server(), timeout_s=timeout_s)
        return self._endpoint

    def _thread_main(self, ready: concurrent.futures.Future[_Loop]) -> None:
        async def main() -> None:
            stop = asyncio.Event()
            ready.set_result(_Loop(asyncio.get_running_loop(), threading.current_thread(), stop))
            await stop.wait()
            await self._shutdown()

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())

    async def _start_server(self) -> str:
        server = aio.server(options=self.options, maximum_concurrent_rpcs=self.cfg.max_concurrent_calls, interceptors=[
            _CallAuthInterceptor(CallAuth(self.secret), callee=lambda: self._endpoint)])
        for register in self._registrations:
            register(server)
        address = f"{self.cfg.host}:{self.cfg.port}"
        port = server.add_insecure_port(address) if self.tls is None else \
            server.add_secure_port(address, self.tls.server_credentials())
        if port == 0:
            raise OSError(f"rpc: could not bind {self.cfg.host}:{self.cfg.port}")
        await server.start()
        self._server = server
        if self.cfg.bulk_transport == "tcp":
            self.bulk = BulkServer(peer_id=self.peer_id, counters=self.counters, pool=self.buffers,
                                   ticket_key=self.secret.tickets, payload_key=self.secret.payloads,
                                   hello_timeout_s=min(self.cfg.call_timeout_s, BULK_HELLO_TIMEOUT_S),
                                   tls=None if self.tls is None else self.tls.server_context)
            await self.bulk.start(self.cfg.host, self.cfg.bulk_port)
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        endpoint = self.cfg.announce or f"{host}:{port}"
        log.info("rpc server of %s listening on %s:%d (announce %s)%s", self.peer_id, self.cfg.host, port, endpoint,
                 "" if self.tls is None else f", TLS, certificate {self.tls.identity.fingerprint()[:16]}")
        return endpoint

    async def _shutdown(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace=0.2)
        if self.bulk is not None:
            await self.bulk.close(grace_s=0.2)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def aclose(self, *, timeout_s: float = 10.0) -> None:
        """Stop the server and close channels (and join the loop thread of a started node), from any loop."""
        if self._loop is None:
            return
        if self._loop.stop is not None:
            await asyncio.to_thread(self.close, timeout_s=timeout_s)
            return
        lp, self._loop = self._loop, None
        if lp.loop is asyncio.get_running_loop():
            await asyncio.wait_for(self._shutdown(), timeout_s)
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                asyncio.wait_for(self._shutdown(), timeout_s), lp.loop))

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop the server, close channels and join the loop thread. A node opened on a loop is closed from
        another thread here, or with `await aclose()` on its loop."""
        if self._loop is None:
            return
        lp = self._loop
        if lp.stop is None:
            if _on_loop(lp.loop):
                raise RuntimeError(f"RpcNode.close of {self.peer_id} on its own loop: await aclose() instead")
            self._loop = None
            if not lp.loop.is_closed():  # a closed loop took its server and channels with it
                asyncio.run_coroutine_threadsafe(self._shutdown(), lp.loop).result(timeout=timeout_s)
            return
        self._loop = None
        lp.loop.call_soon_threadsafe(lp.stop.set)
        lp.thread.join(timeout=timeout_s)
        if lp.thread.is_alive():
            raise TimeoutError(f"rpc loop of {self.peer_id} did not stop within {timeout_s}s")

    def __enter__(self) -> RpcNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running work ----------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """host:port others dial ('' in client mode)."""
        return self._endpoint

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self._loop is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("RpcNode: not started")
        return self._loop.loop

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the node's loop: directly when the caller runs on it, else handed over to it."""
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        if loop is asyncio.get_running_loop():
            return await coro
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the node's loop is gone: the node was closed under the caller
            coro.close()
            raise
        return await asyncio.wrap_future(future)

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        """Run `coro` on the node's loop and block for its result (cancelled after `timeout_s`), from a thread
        other than the loop's (on the loop itself it would wait for itself: RuntimeError)."""
        loop = self.loop
        if _on_loop(loop):
            coro.close()
            raise RuntimeError(f"RpcNode.run on {self.peer_id}'s own loop would block it: await node.call() there")
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"rpc: call on {self.peer_id}'s loop took longer than {timeout_s:.1f}s") from None

    # -- client side -----------------------------------------------------------------------
    def channel(self, endpoint: str) -> aio.Channel:
        """A cached channel to `endpoint` (call from the node's loop)."""
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = aio.insecure_channel(endpoint, options=self.options) if self.tls is None else \
                aio.secure_channel(endpoint, self.tls.channel_credentials(),
                                   options=[*self.options, *self.tls.channel_options()])
            self._channels[endpoint] = ch
        return ch

    def metadata(self, method: str, endpoint: str) -> tuple[tuple[str, str], ...]:
        """Metadata of one outgoing call of `method` (its full name, "/package.Service/Method") to
        `endpoint`: our peer id and a fresh proof of the run key (never the key itself)."""
        return ((PEER_HEADER, self.peer_id),
                (AUTH_HEADER, self._signer.header(method=method, callee=endpoint, now=time.time())))

    @property
    def bulk_tls(self) -> ssl.SSLContext | None:
        """The client context bulk transfers use with `rpc.tls`, else None."""
        return None if self.tls is None else self.tls.client_context

    def ticket_proof(self, token: bytes) -> bytes:
        """What this node sends with a bulk ticket it was given: proof that it is the caller it was issued to."""
        return bulk.ticket_proof(self.secret.tickets, token, self.peer_id)

    async def retrying(self, call: Callable[[], Awaitable[T]], *, endpoint: str, deadline: float, what: str) -> T:
        """Await `call()` (a call to `endpoint`); on RpcUnavailable retry up to `rpc.retries` times with
        jittered exponential backoff, never past `deadline` (time.monotonic()). Only for idempotent calls.
        A call on a channel this node closed meanwhile (the node is shutting down, as a crashing peer's does
        under its own round) is RpcUnavailable too, not a bug."""
        attempt = 0
        while True:
            try:
                try:
                    return await call()
                except aio.UsageError as e:  # grpc's "Channel is closed"
                    raise RpcUnavailable(f"UNAVAILABLE: {what}: the channel to {endpoint} is closed ({e})") from None
            except RpcUnavailable as e:
                delay_s = self.cfg.backoff_s * (2 ** attempt) * (0.5 + random.random())
                if attempt >= self.cfg.retries or time.monotonic() + delay_s >= deadline:
                    raise
                attempt += 1
                log.info("%s: %s; retry %d/%d in %.2fs", what, e, attempt, self.cfg.retries, delay_s)
                await asyncio.sleep(delay_s)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def peer_of(context: aio.ServicerContext) -> str:
    """The calling peer's id from its metadata (covered by the call's MAC: a holder of the run key said it)."""
    for key, value in context.invocation_metadata() or ():
        if key == PEER_HEADER:
            return str(value)
    return "?"


def remaining_s(deadline: float) -> float:
    """Seconds left until `deadline` (time.monotonic()), at least a millisecond so grpc gets a deadline."""
    return max(deadline - time.monotonic(), 1e-3)
