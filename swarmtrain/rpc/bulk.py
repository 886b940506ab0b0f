"""The bulk data path: large payloads over a raw TCP port against one-time tickets, without per-chunk copies.

gRPC stays the control plane: a run-key-authenticated call validates a transfer and asks the
node's BulkServer for a ticket (a random token bound to the calling peer, the payload's size and
the call's deadline). The bytes then move over this module's port with `sock_sendall(memoryview)`
and `sock_recv_into(preallocated buffer)`: the kernel's copy per side and no Python work per chunk,
where gRPC adds two user-space copies per side and its own framing, which made it the all-reduce's
bottleneck on a CPU-bound box.

Wire (big-endian). The client connects and sends MAGIC + token + proof, the proof an HMAC (under the
run's tickets key) of the token and the peer id the ticket was issued to: a token seen on the wire is
useless to anyone else. The server answers a status (u8 code index into CODES, u32 length, utf-8
message). A bad token or proof is answered UNAUTHENTICATED, logged, and the connection closed.
Upload: on OK the client streams the ticket's size in bytes, then their MAC (keyed BLAKE3 under the
run's payloads key, over the token and the bytes' BLAKE3 digest; trust/payloads.py), and half-closes; the
server reads them into a buffer of exactly that size (EOF before it: truncated; bytes after the MAC:
oversized), checks the MAC, hands the buffer to the ticket's consumer and answers a final status. Download:
on OK the server sends u64 size, the bytes and their MAC, then closes; the client's bytes land in pooled
memory that is its own (it goes back to the pool when nothing refers to it), with their digest. A payload
altered on the way fails its MAC. The MAC covers the digest so that one pass over the bytes per side gives
the MAC and the digest a round's material is named by, and a mean offered to several members at once is
digested once.
Every read and write runs under the ticket's deadline, the hello under `hello_timeout_s` (at most
BULK_HELLO_TIMEOUT_S).

Before its hello is accepted a connection costs its socket and a task, nothing else: no buffer is
allocated for it, and at most `max_unauthenticated` such connections live at once (a newer one
closes the oldest), so junk connections cannot crowd out the members' transfers or the process's
file descriptors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from blake3 import blake3

from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import Rejected, RpcRejected, RpcTimeout, RpcUnavailable, status_name
from swarmtrain.rpc.links import Link, RawLink, open_tls
from swarmtrain.rpc.payload_macs import digest_of
from swarmtrain.trust.payloads import MAC_BYTES, check_payload_mac, payload_mac
from swarmtrain.trust.tls import TLS_NAME

if TYPE_CHECKING:
    from swarmtrain.rpc.node import ByteCounters

__all__ = ["BULK_HELLO_TIMEOUT_S", "CODES", "MAC_BYTES", "MAGIC", "PROOF_BYTES", "TOKEN_BYTES", "BulkRefused",
           "BulkServer", "Downloaded", "check_hello", "download", "host_of", "ticket_proof", "upload"]

log = logging.getLogger(__name__)

MAGIC = b"STB3"  # 3: the MAC covers the payload's digest
TOKEN_BYTES = 16
PROOF_BYTES = 16
BULK_HELLO_TIMEOUT_S = 2.0  # a member's hello follows its ticket call at once
MAX_UNAUTHENTICATED = 64  # connections still before their hello; a new one past it closes the oldest
MAX_TICKETS_PER_PEER = 32  # open tickets of one caller; a new one past it voids that caller's oldest
MAX_TRANSFERS_PER_PEER = 16  # transfers of one caller running at once (each may hold a payload's buffer)
MAX_TICKET_TTL_S = 600.0  # however long a caller's deadline, a ticket is void after this
CODES = ("OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED",
         "ABORTED")
_STATUS = struct.Struct("!BI")
_SIZE = struct.Struct("!Q")
_MAX_MESSAGE_BYTES = 4096
_ACCEPT_BACKOFF_S = (0.05, 1.0)  # after a failed accept (out of file descriptors): first and longest wait
_HASH_STEP = 1 << 20  # bytes hashed at a time while a payload moves (in the cache, on the loop)
_DRAIN_BYTES = 1 << 20  # read (and drop) at most this much after a refusal, so the refusal is not lost to a reset
_DRAIN_SCRATCH = memoryview(bytearray(1 << 16))  # shared by every drain: what is read there is dropped

Consumer = Callable[[memoryview], Awaitable[None]]


class BulkRefused(Exception):
    """The server refuses a connection or a transfer; `code` (one of CODES) goes back to the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code



class Downloaded(NamedTuple):
    """A download's bytes (the caller's own: pooled memory that goes back by itself once unreferenced) and their
    BLAKE3 digest (trust/payloads.payload_digest), checked against the sender's MAC."""

    view: memoryview
    digest: bytes


class _Digest:
    """The digest of one payload offered to several downloads at once, taken once: `data` is held so that its
    id cannot name another object while tickets for it are open."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = data
        self.users = 0
        self.task: asyncio.Task[bytes] | None = None


def _bulk_mac(key: bytes, token: bytes, digest: bytes) -> bytes:
    return payload_mac(key, b"bulk", token, digest)


class _Eof(ConnectionError):
    """The other side closed the connection before the bytes we needed arrived."""


@dataclass
class _Ticket:
    peer: str
    what: str
    size_bytes: int
    deadline: float  # time.monotonic()
    consume: Consumer | None = None  # an upload
    data: bytes | bytearray | memoryview | None = None  # a download
    on_sent: Callable[[], Awaitable[None]] | None = None
    expiry: asyncio.TimerHandle | None = None
    token: bytes = b""  # set when claimed: what the payload's MAC covers with it


def ticket_proof(key: bytes, token: bytes, peer: str) -> bytes:
    """The proof a caller sends with `token`: it was issued to `peer`, and the sender holds the run key."""
    return hmac.new(key, token + b"\0" + peer.encode(), hashlib.sha256).digest()[:PROOF_BYTES]


def check_hello(hello: bytes, *, key: bytes, issued_to: Callable[[bytes], str | None]) -> bytes:
    """The ticket token of a hello that is MAGIC + a token we issued (`issued_to(token)`: the peer it was
    issued to, or None) + that peer's proof of it; else BulkRefused saying what was wrong."""
    if len(hello) != len(MAGIC) + TOKEN_BYTES + PROOF_BYTES or hello[:len(MAGIC)] != MAGIC:
        raise BulkRefused("UNAUTHENTICATED", "not a bulk connection (bad magic)")
    token, proof = hello[len(MAGIC):len(MAGIC) + TOKEN_BYTES], hello[len(MAGIC) + TOKEN_BYTES:]
    peer = issued_to(token)
    if peer is None:
        raise BulkRefused("UNAUTHENTICATED", "unknown, used or expired bulk ticket")
    if not hmac.compare_digest(proof, ticket_proof(key, token, peer)):
        raise BulkRefused("UNAUTHENTICATED", f"the ticket was issued to {peer}; this connection cannot prove it "
                                             "is that peer")
    return token


async def _drain(link: Link) -> None:
    """Read and drop what the other side still sends (up to _DRAIN_BYTES), so our last status is not
    lost to a reset; no buffer of its own."""
    left = _DRAIN_BYTES
    while left > 0:
        n = await link.recv_into(_DRAIN_SCRATCH[:min(left, len(_DRAIN_SCRATCH))])
        if n == 0:
            return
        left -= n


async def _recv_exact(link: Link, size: int) -> bytearray:
    buf = bytearray(size)
    got = await _recv_into(link, memoryview(buf))
    if got < size:
        raise _Eof(f"connection closed after {got} of {size} bytes")
    return buf


async def _recv_into(link: Link, view: memoryview) -> int:
    """Fill `view` from `link`; the number of bytes read, short only when the other side closed."""
    got = 0
    while got < len(view):
        n = await link.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


async def _recv_hashed(link: Link, view: memoryview) -> tuple[int, bytes]:
    """`_recv_into`, hashing the bytes (trust/payloads.payload_digest) a MiB at a time as they arrive, while
    they are still in the cache: the receiver's one pass over them is the copy out of the socket."""
    hasher, got, hashed = blake3(), 0, 0
    while got < len(view):
        n = await link.recv_into(view[got:])
        if n == 0:
            break
        got += n
        if got - hashed >= _HASH_STEP:
            hasher.update(view[hashed:got])
            hashed = got
    hasher.update(view[hashed:got])
    return got, hasher.digest()


async def _send_hashed(link: Link, data: bytes | bytearray | memoryview) -> bytes:
    """Send `data`, hashing each MiB just before it goes (`_recv_hashed`'s counterpart); returns the digest."""
    hasher, view = blake3(), memoryview(data).cast("B")
    for lo in range(0, len(view), _HASH_STEP):
        piece = view[lo:lo + _HASH_STEP]
        hasher.update(piece)
        await link.sendall(piece)
    return hasher.digest()


async def _send_status(link: Link, code: str, message: str = "", tail: bytes = b"") -> None:
    text = message.encode()[:_MAX_MESSAGE_BYTES]
    await link.sendall(_STATUS.pack(CODES.index(code), len(text)) + text + tail)


async def _read_status(link: Link) -> tuple[str, str]:
    index, length = _STATUS.unpack(await _recv_exact(link, _STATUS.size))
    if index >= len(CODES) or length > _MAX_MESSAGE_BYTES:
        raise RpcRejected("INVALID_REPLY", f"bulk status {index} with a {length}-byte message is malformed")
    return CODES[index], (await _recv_exact(link, length)).decode(errors="replace")


class BulkServer:
    """A node's bulk port. Lives on the node's loop; `expect_upload` / `offer_download` issue tickets."""

    def __init__(self, *, peer_id: str, counters: ByteCounters, pool: BufferPool, ticket_key: bytes,
                 payload_key: bytes, hello_timeout_s: float = BULK_HELLO_TIMEOUT_S,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED, tls: ssl.SSLContext | None = None) -> None:
        if hello_timeout_s <= 0 or max_unauthenticated < 1:
            raise ValueError(f"BulkServer: hello_timeout_s must be > 0 and max_unauthenticated >= 1, got "
                             f"{hello_timeout_s}, {max_unauthenticated}")
        self.peer_id = peer_id
        self.counters = counters
        self.pool = pool
        self.hello_timeout_s = hello_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self._ticket_key = ticket_key
        self._payload_key = payload_key
        self._tls = tls  # a server context: every connection is TLS (rpc.tls), handshake within the hello deadline
        self._tickets: dict[bytes, _Ticket] = {}
        self._tickets_of: dict[str, collections.OrderedDict[bytes, None]] = {}  # peer -> its open tokens, oldest first
        self._running_of: collections.Counter[str] = collections.Counter()  # peer -> its transfers running
        self._unauthenticated: collections.OrderedDict[asyncio.Task[None], None] = collections.OrderedDict()
        self.refused_connections = 0  # closed before or at their hello (junk, bad proof, crowded out)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._transfers: set[asyncio.Task[None]] = set()
        self._digests: dict[int, _Digest] = {}  # id(offered data) -> its digest, while tickets for it are open
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = any free port); returns the bound port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=128)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop(listener))
        log.info("bulk port of %s listening on %s:%d", self.peer_id, host, self.port)
        return self.port

    async def close(self, *, grace_s: float = 0.0) -> None:
        """Stop listening, let transfers in flight finish for up to `grace_s`, then cut them off."""
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for ticket in self._tickets.values():
            if ticket.expiry is not None:
                ticket.expiry.cancel()
            self._forget_digest(ticket)
        self._tickets.clear()
        self._tickets_of.clear()
        if self._transfers and grace_s > 0:
            await asyncio.wait(set(self._transfers), timeout=grace_s)
        for task in list(self._transfers):
            task.cancel()
        await asyncio.gather(*self._transfers, return_exceptions=True)

    def expect_upload(self, *, peer: str, what: str, size_bytes: int, deadline: float, consume: Consumer) -> bytes:
        """A token for `peer` to send exactly `size_bytes` (already checked against the caller's limit);
        `consume(view)` takes them and may raise `Rejected`, which the uploader receives. The view is the
        consumer's: lent pooled memory that goes back once nothing refers to it."""
        return self._issue(_Ticket(peer, what, size_bytes, deadline, consume=consume))

    def offer_download(self, *, peer: str, what: str, data: bytes | bytearray | memoryview, deadline: float,
                       on_sent: Callable[[], Awaitable[None]] | None = None) -> bytes:
        """A token for `peer` to receive `data` once; `on_sent()` runs when the bytes are out. The same `data`
        offered to several peers at once is digested once."""
        token = self._issue(_Ticket(peer, what, len(data), deadline, data=data, on_sent=on_sent))
        memo = self._digests.setdefault(id(data), _Digest(data))  # it holds `data`: the id names no other object
        memo.users += 1
        return token

    def _digest(self, data: bytes | bytearray | memoryview) -> asyncio.Task[bytes]:
        """The digest of an offered payload (held until its last ticket is done, `_forget_digest`)."""
        memo = self._digests[id(data)]
        if memo.task is None:
            memo.task = asyncio.get_running_loop().create_task(digest_of(data))
        return memo.task

    def _forget_digest(self, ticket: _Ticket) -> None:
        """A download ticket is done (sent, failed or void): its payload's digest goes with its last ticket."""
        if ticket.data is None:
            return
        memo = self._digests[id(ticket.data)]
        memo.users -= 1
        if memo.users == 0:
            del self._digests[id(ticket.data)]

    def _issue(self, ticket: _Ticket) -> bytes:
        if self._listener is None:
            raise Rejected(f"{self.peer_id}'s bulk port is closed", kind="precondition")
        token = secrets.token_bytes(TOKEN_BYTES)
        ticket.deadline = min(ticket.deadline, time.monotonic() + MAX_TICKET_TTL_S)
        ttl_s = max(ticket.deadline - time.monotonic(), 0.0)
        ticket.expiry = asyncio.get_running_loop().call_later(ttl_s, self._void, token)
        self._tickets[token] = ticket
        mine = self._tickets_of.setdefault(ticket.peer, collections.OrderedDict())
        mine[token] = None
        while len(mine) > MAX_TICKETS_PER_PEER:  # a caller asking for tickets it never uses: its oldest goes
            oldest = next(iter(mine))
            log.info("%s: voided a bulk ticket of %s (more than %d open)", self.peer_id, ticket.peer,
                     MAX_TICKETS_PER_PEER)
            self._void(oldest)
        return token

    def _void(self, token: bytes, *, claimed: bool = False) -> _Ticket | None:
        """Forget `token` (expired, claimed, or crowded out by its caller's newer ones)."""
        ticket = self._tickets.pop(token, None)
        if ticket is None:
            return None
        if not claimed:
            self._forget_digest(ticket)
        if ticket.expiry is not None:
            ticket.expiry.cancel()
        mine = self._tickets_of.get(ticket.peer)
        if mine is not None:
            mine.pop(token, None)
            if not mine:
                del self._tickets_of[ticket.peer]
        return ticket

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff_s = _ACCEPT_BACKOFF_S[0]
        while True:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as e:  # e.g. out of file descriptors: free the oldest stranger's, wait, go on
                if backoff_s == _ACCEPT_BACKOFF_S[0]:
                    log.warning("%s: bulk port accept failed: %s", self.peer_id, e)
                self._crowd_out_oldest()
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, _ACCEPT_BACKOFF_S[1])
                continue
            backoff_s = _ACCEPT_BACKOFF_S[0]
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._unauthenticated) >= self.max_unauthenticated:
                self._crowd_out_oldest()
            task = loop.create_task(self._serve(conn, str(addr)))
            self._unauthenticated[task] = None
            self._transfers.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._transfers.discard(task)
        self._unauthenticated.pop(task, None)

    def _crowd_out_oldest(self) -> None:
        if self._unauthenticated:
            oldest, _ = self._unauthenticated.popitem(last=False)
            oldest.cancel()
            self.refused_connections += 1

    async def _serve(self, conn: socket.socket, addr: str) -> None:
        loop = asyncio.get_running_loop()
        ticket: _Ticket | None = None
        link: Link = RawLink(loop, conn)
        with conn:
            try:
                async with asyncio.timeout(self.hello_timeout_s):
                    if self._tls is not None:
                        link = await open_tls(loop, conn, self._tls, server_side=True)
                    hello = bytes(await _recv_exact(link, len(MAGIC) + TOKEN_BYTES + PROOF_BYTES))
                ticket = self._claim(hello)
                self._unauthenticated.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
                self._forget_digest_after(ticket)
                if self._running_of[ticket.peer] >= MAX_TRANSFERS_PER_PEER:
                    raise BulkRefused("RESOURCE_EXHAUSTED", f"{ticket.peer} already runs {MAX_TRANSFERS_PER_PEER} "
                                                            "transfers here")
                self._running_of[ticket.peer] += 1
                try:
                    async with asyncio.timeout(max(ticket.deadline - time.monotonic(), 1e-3)):
                        if ticket.consume is not None:
                            await self._receive(link, ticket)
                        else:
                            await self._send(link, ticket)
                finally:
                    self._running_of[ticket.peer] -= 1
                    if not self._running_of[ticket.peer]:
                        del self._running_of[ticket.peer]
            except BulkRefused as e:
                if ticket is None:
                    self.refused_connections += 1
                who = f"{ticket.what} from {ticket.peer}" if ticket else "a connection"
                log.warning("%s refused bulk %s (%s): %s", self.peer_id, who, addr, e)
                with contextlib.suppress(OSError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await _send_status(link, e.code, str(e))
                        link.shutdown_write()
                        await _drain(link)
            except TimeoutError:
                if ticket is None:
                    self.refused_connections += 1
                log.info("%s: bulk %s (%s) missed its deadline", self.peer_id, ticket.what if ticket else
                         "hello", addr)
            except ssl.SSLError as e:  # before OSError: a failed handshake or a record that does not decrypt
                if ticket is None:
                    self.refused_connections += 1
                log.warning("%s: bulk %s (%s) failed TLS: %s", self.peer_id, ticket.what if ticket else "hello",
                            addr, e)
            except OSError as e:
                log.info("%s: bulk %s (%s) lost its connection: %s", self.peer_id, ticket.what if ticket else
                         "hello", addr, e)

    def _claim(self, hello: bytes) -> _Ticket:
        def issued_to(token: bytes) -> str | None:
            ticket = self._tickets.get(token)
            return None if ticket is None else ticket.peer

        token = check_hello(hello, key=self._ticket_key, issued_to=issued_to)
        ticket = self._void(token, claimed=True)
        assert ticket is not None  # check_hello found it just now, on this loop
        ticket.token = token
        return ticket

    def _forget_digest_after(self, ticket: _Ticket) -> None:
        """A claimed download's digest is forgotten when its transfer ends, however it ends."""
        if ticket.data is not None:
            task = asyncio.current_task()
            assert task is not None
            task.add_done_callback(lambda _: self._forget_digest(ticket))

    async def _receive(self, link: Link, ticket: _Ticket) -> None:
        assert ticket.consume is not None
        await _send_status(link, "OK")
        view = self.pool.lent(ticket.size_bytes)  # the consumer's once it is handed over
        got, digest = await _recv_hashed(link, view)
        self.counters.add_received(ticket.peer, got)
        if got < ticket.size_bytes:
            raise BulkRefused("INVALID_ARGUMENT", f"truncated {ticket.what}: got {got} of {ticket.size_bytes} bytes")
        mac = bytearray(MAC_BYTES)
        if await _recv_into(link, memoryview(mac)) < MAC_BYTES:
            raise BulkRefused("INVALID_ARGUMENT", f"truncated {ticket.what}: its MAC is missing")
        if await link.recv_into(memoryview(bytearray(1))):
            raise BulkRefused("RESOURCE_EXHAUSTED", f"{ticket.what} carries more than the {ticket.size_bytes} "
                                                    "bytes it declared")
        if not check_payload_mac(self._payload_key, bytes(mac), b"bulk", ticket.token, digest):
            raise BulkRefused("INVALID_ARGUMENT", f"{ticket.what}: its MAC is wrong (altered on the way?)")
        try:
            await ticket.consume(view)
        except Rejected as e:
            raise BulkRefused(status_name(e), str(e)) from None
        await _send_status(link, "OK")

    async def _send(self, link: Link, ticket: _Ticket) -> None:
        assert ticket.data is not None
        await _send_status(link, "OK", tail=_SIZE.pack(ticket.size_bytes))
        digest = self._digest(ticket.data)  # hashed while it is sent (once for all its tickets)
        await link.sendall(memoryview(ticket.data))
        await link.sendall(_bulk_mac(self._payload_key, ticket.token, await asyncio.shield(digest)))
        self.counters.add_sent(ticket.peer, ticket.size_bytes)
        link.shutdown_write()
        if ticket.on_sent is not None:
            await ticket.on_sent()


# -- client side ---------------------------------------------------------------------------------
def host_of(endpoint: str) -> str:
    """The host part of a gRPC host:port ([v6] brackets removed): the bulk port lives on the same host."""
    return endpoint.rpartition(":")[0].strip("[]")


async def _connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _expect_ok(link: Link, what: str) -> None:
    code, message = await _read_status(link)
    if code != "OK":
        raise RpcRejected(code, message or f"{what} refused")


@contextlib.asynccontextmanager
async def _transfer(host: str, port: int, token: bytes, proof: bytes, *, deadline: float, what: str,
                    tls: ssl.SSLContext | None) -> AsyncIterator[Link]:
    """A connection (TLS with a client context `tls`) that presented `token` and was accepted; socket and
    TLS errors become RpcError subclasses."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 1e-3)):
            sock = await _connect(loop, host, port)
            with sock:
                link: Link = RawLink(loop, sock) if tls is None else \
                    await open_tls(loop, sock, tls, server_side=False, server_hostname=TLS_NAME)
                await link.sendall(MAGIC + token + proof)
                await _expect_ok(link, what)
                yield link
    except TimeoutError:
        raise RpcTimeout(f"DEADLINE_EXCEEDED: bulk {what} via {host}:{port}") from None
    except ssl.SSLCertVerificationError as e:  # not a certificate of this run's authority
        raise RpcRejected("UNAUTHENTICATED", f"bulk {what} via {host}:{port}: {e.verify_message}") from None
    except OSError as e:  # refused, reset, closed early, a TLS record that does not decrypt
        raise RpcUnavailable(f"UNAVAILABLE: bulk {what} via {host}:{port}: {e}") from None


async def upload(host: str, port: int, token: bytes, proof: bytes, payload: bytes | bytearray | memoryview, *,
                 mac_key: bytes, deadline: float, what: str, counters: ByteCounters, peer: str,
                 tls: ssl.SSLContext | None = None) -> None:
    """Send `payload` against an upload ticket (with our `ticket_proof` of it) and its MAC under `mac_key`,
    and wait for the consumer's verdict (RpcRejected if refused)."""
    async with _transfer(host, port, token, proof, deadline=deadline, what=what, tls=tls) as link:
        digest = await _send_hashed(link, payload)
        await link.sendall(_bulk_mac(mac_key, token, digest))
        counters.add_sent(peer, len(payload))
        link.shutdown_write()
        await _expect_ok(link, what)


async def download(host: str, port: int, token: bytes, proof: bytes, *, mac_key: bytes, size_bytes: int,
                   deadline: float, what: str, counters: ByteCounters, peer: str, pool: BufferPool,
                   tls: ssl.SSLContext | None = None) -> Downloaded:
    """The `size_bytes` (from the ticket, checked by the caller) offered against a download ticket, in memory
    lent by `pool` (the caller's: it goes back by itself), with their digest; RpcRejected if their MAC under
    `mac_key` is wrong."""
    async with _transfer(host, port, token, proof, deadline=deadline, what=what, tls=tls) as link:
        (size,) = _SIZE.unpack(await _recv_exact(link, _SIZE.size))
        if size != size_bytes:
            raise RpcRejected("INVALID_REPLY", f"{what} declares {size} bytes, its ticket {size_bytes}")
        view = pool.lent(size)
        got, digest = await _recv_hashed(link, view)
        counters.add_received(peer, got)
        if got < size:
            raise _Eof(f"{what}: connection closed after {got} of {size} bytes")
        mac = bytes(await _recv_exact(link, MAC_BYTES))
        if await link.recv_into(memoryview(bytearray(1))):
            raise RpcRejected("INVALID_REPLY", f"{what} exceeds its declared {size} bytes")
        if not check_payload_mac(mac_key, mac, b"bulk", token, digest):
            raise RpcRejected("INVALID_REPLY", f"{what}: its MAC is wrong (altered on the way?)")
        return Downloaded(view, digest)
