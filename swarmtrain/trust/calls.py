"""A MAC per gRPC call: the caller proves it holds the run key without sending it, and no call is accepted twice.

The caller sends `x-swarmtrain-peer: <its id>` and `x-swarmtrain-auth: 1.<unix ms>.<nonce>.<mac>`, the MAC
(HMAC-SHA256 under the calls key) covering the method, the caller's id, the endpoint it dialed, the time
and the nonce. The callee recomputes it for its own endpoint, refuses a time outside ±`window_s` of its
clock, and remembers the accepted nonces of each caller while their time is inside the window, so a
captured header is worth nothing: not on another method, another callee, after the window, or a second time.

Memory is bounded without ever refusing a fresh call: each caller's nonces are kept up to
`max_per_caller`, and past that the oldest (by their time) are forgotten and the caller's *floor* rises to
the newest time forgotten: a call of that caller at or before its floor is refused as possibly replayed.
An honest caller stamps its calls with its clock as it makes them, so its new calls are always above its
floor; only a call delayed, in flight, past `max_per_caller` later calls of the same caller would be
refused. Callers are kept up to `max_callers`, the least recently heard from forgotten first, and the
forgotten caller's newest time (at most the callee's clock) becomes the floor of every caller not
remembered. A key holder flooding under many made-up caller ids thus makes callers it has not heard from
refuse calls stamped before that floor (a clock running that far behind), never calls stamped now; a
forgotten caller's call stamped ahead of the callee's clock could then be replayed once.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import hmac
import re
import secrets

from swarmtrain.trust.keys import RunSecret

__all__ = ["AUTH_HEADER", "CALL_WINDOW_S", "PEER_HEADER", "CallAuth", "CallRefused", "CallSigner"]

AUTH_HEADER = "x-swarmtrain-auth"
PEER_HEADER = "x-swarmtrain-peer"
CALL_WINDOW_S = 300.0  # clocks of peers may differ this much; a captured call is refused after it
MAX_PER_CALLER = 256  # nonces remembered per caller; past it, the oldest go and the caller's floor rises
MAX_CALLERS = 2048  # callers remembered; past it, the least recently heard from goes
_HEADER_RE = re.compile(r"^1\.(\d{1,16})\.([0-9a-f]{32})\.([0-9a-f]{64})$")


class CallRefused(Exception):
    """A call without valid proof of the run key; the message says what was wrong (never secret)."""


def _mac(key: bytes, *, method: str, caller: str, callee: str, at_ms: int, nonce: str) -> str:
    msg = "\n".join(("1", method, caller, callee, str(at_ms), nonce)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


class CallSigner:
    """The caller's side: one fresh header per call (a retry is a new call)."""

    def __init__(self, secret: RunSecret, *, peer_id: str) -> None:
        self._key = secret.calls
        self.peer_id = peer_id

    def header(self, *, method: str, callee: str, now: float) -> str:
        at_ms, nonce = int(now * 1000), secrets.token_hex(16)
        mac = _mac(self._key, method=method, caller=self.peer_id, callee=callee, at_ms=at_ms, nonce=nonce)
        return f"1.{at_ms}.{nonce}.{mac}"


class _Caller:
    """What a callee remembers of one caller: the accepted (time, nonce) pairs inside the window, and its floor."""

    __slots__ = ("floor_ms", "heap", "nonces")

    def __init__(self, floor_ms: int) -> None:
        self.heap: list[tuple[int, str]] = []  # (at ms, nonce), oldest first
        self.nonces: set[str] = set()
        self.floor_ms = floor_ms

    def forget_before(self, ms: int) -> None:
        while self.heap and self.heap[0][0] < ms:
            self.nonces.discard(heapq.heappop(self.heap)[1])

    def newest_ms(self) -> int:
        return max((at for at, _ in self.heap), default=self.floor_ms)


class CallAuth:
    """The callee's side: `check` accepts a call once or raises CallRefused. Not thread-safe: one event loop."""

    def __init__(self, secret: RunSecret, *, window_s: float = CALL_WINDOW_S, max_per_caller: int = MAX_PER_CALLER,
                 max_callers: int = MAX_CALLERS) -> None:
        if window_s <= 0 or max_per_caller <= 0 or max_callers <= 0:
            raise ValueError(f"CallAuth: window_s, max_per_caller and max_callers must be > 0, got {window_s}, "
                             f"{max_per_caller}, {max_callers}")
        self._key = secret.calls
        self.window_s = window_s
        self.max_per_caller = max_per_caller
        self.max_callers = max_callers
        self._callers: collections.OrderedDict[str, _Caller] = collections.OrderedDict()  # least recent first
        self._floor_ms = -1  # of callers not remembered: the newest time of a forgotten caller

    def check(self, *, method: str, caller: str, callee: str, header: str, now: float) -> None:
        m = _HEADER_RE.match(header)
        if m is None:
            raise CallRefused("missing or malformed call proof (a peer without the run key, or of an older version)")
        at_ms, nonce, mac = int(m.group(1)), m.group(2), m.group(3)
        want = _mac(self._key, method=method, caller=caller, callee=callee, at_ms=at_ms, nonce=nonce)
        if not hmac.compare_digest(mac, want):
            raise CallRefused("wrong run key (or a call made for another peer or method)")
        skew_s = at_ms / 1000 - now
        if abs(skew_s) > self.window_s:
            raise CallRefused(f"call made {skew_s:+.0f}s from this peer's clock, outside ±{self.window_s:.0f}s "
                              "(a replayed call, or a clock far off)")
        entry = self._callers.get(caller)
        if entry is None:
            entry = self._remember(caller, now_ms=int(now * 1000))
        else:
            self._callers.move_to_end(caller)
        # A time outside the window is refused above, so its nonce need not be remembered any more.
        entry.forget_before(int((now - self.window_s) * 1000))
        if at_ms <= entry.floor_ms:
            raise CallRefused(f"a call stamped {(entry.floor_ms - at_ms) / 1000:.3f}s before the oldest this peer "
                              f"still remembers of {caller[:64]!r} (possibly replayed; this peer keeps "
                              f"{self.max_per_caller} calls per caller)")
        if nonce in entry.nonces:
            raise CallRefused("a replayed call (its nonce was already used)")
        heapq.heappush(entry.heap, (at_ms, nonce))
        entry.nonces.add(nonce)
        while len(entry.heap) > self.max_per_caller:
            old_ms, old = heapq.heappop(entry.heap)
            entry.nonces.discard(old)
            entry.floor_ms = max(entry.floor_ms, old_ms)

    def _remember(self, caller: str, *, now_ms: int) -> _Caller:
        while len(self._callers) >= self.max_callers:
            _, gone = self._callers.popitem(last=False)
            # Never above this clock: a flood stamped ahead must not make callers stamping now look replayed.
            self._floor_ms = max(self._floor_ms, min(gone.newest_ms(), now_ms - 1))
        entry = self._callers[caller] = _Caller(self._floor_ms)
        return entry

    def remembered(self) -> int:
        """How many nonces are remembered (all callers)."""
        return sum(len(c.heap) for c in self._callers.values())
