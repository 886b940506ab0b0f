"""A bulk-port connection, plain or TLS, behind one small interface (rpc/bulk.py moves bytes over it).

Plain: the event loop's `sock_recv_into` / `sock_sendall` on the socket, no copy in Python. TLS: an
`ssl.SSLObject` over memory BIOs driven by the same socket calls (asyncio refuses SSL sockets in
its `sock_*` calls, and streams would copy every chunk twice more). A side ends its sending with a
TCP half-close and no TLS close_notify, so the other side reads an EOF "in violation of protocol":
that is taken as the end of the stream. Truncation gains an attacker nothing here: the bulk
protocol declares every size and MACs every payload.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Protocol

__all__ = ["Link", "RawLink", "TlsLink", "open_tls"]

_SCRATCH_BYTES = 1 << 18  # ciphertext read from the socket per call
_WRITE_BYTES = 1 << 20  # plaintext encrypted per call: bounds the ciphertext held at once


class Link(Protocol):
    sock: socket.socket

    async def recv_into(self, view: memoryview) -> int:
        """Read at most len(view) bytes into `view`; 0 at the end of the stream."""
        ...

    async def sendall(self, data: bytes | bytearray | memoryview) -> None: ...

    def shutdown_write(self) -> None:
        """No more bytes from this side (the other side reads the end of the stream)."""
        ...


class RawLink:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop, self.sock = loop, sock

    async def recv_into(self, view: memoryview) -> int:
        return await self.loop.sock_recv_into(self.sock, view)

    async def sendall(self, data: bytes | bytearray | memoryview) -> None:
        await self.loop.sock_sendall(self.sock, data)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)


class TlsLink:
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, ctx: ssl.SSLContext, *,
                 server_side: bool, server_hostname: str | None) -> None:
        self.loop, self.sock = loop, sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._scratch = bytearray(_SCRATCH_BYTES)

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionResetError("TLS handshake: the other side closed the connection") from None
        await self._flush()

    async def _flush(self) -> None:
        if self._out.pending:
            await self.loop.sock_sendall(self.sock, self._out.read())

    async def _fill(self) -> bool:
        n = await self.loop.sock_recv_into(self.sock, self._scratch)
        if n == 0:
            self._in.write_eof()
            return False
        self._in.write(memoryview(self._scratch)[:n])
        return True

    async def recv_into(self, view: memoryview) -> int:
        if not len(view):
            return 0
        while True:
            try:
                return self._tls.read(len(view), view)  # type: ignore[return-value]  # given a buffer: a count
            except ssl.SSLWantReadError:
                if self._in.eof:  # the end of the stream, with no TLS record left half-read
                    return 0
                await self._flush()  # e.g. a key update to answer
                await self._fill()  # at the end of the stream, the next read reports it
            except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                return 0

    async def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _WRITE_BYTES):
            self._tls.write(view[start:start + _WRITE_BYTES])
            await self._flush()

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)


async def open_tls(loop: asyncio.AbstractEventLoop, sock: socket.socket, ctx: ssl.SSLContext, *,
                   server_side: bool, server_hostname: str | None = None) -> TlsLink:
    """A TLS link over a connected non-blocking `sock`, handshake done (ssl.SSLError if it fails)."""
    link = TlsLink(loop, sock, ctx, server_side=server_side, server_hostname=server_hostname)
    await link.handshake()
    return link
