"""A MAC per gRPC call: the caller proves it holds the run key without sending it, and no call is accepted twice.

The caller sends `x-swarmtrain-peer: <its id>` and `x-swarmtrain-auth: 1.<unix ms>.<nonce>.<mac>`, the MAC
(HMAC-SHA256 under the calls key) covering the method, the caller's id, the endpoint it dialed, the time
and the nonce. The callee recomputes it for its own endpoint, refuses a time outside ±`window_s` of its
clock, and remembers every accepted nonce for that long, so a captured header is worth nothing: not on
another method, another callee, after the window, or a second time.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import re
import secrets

from swarmtrain.trust.keys import RunSecret

__all__ = ["AUTH_HEADER", "CALL_WINDOW_S", "PEER_HEADER", "CallAuth", "CallRefused", "CallSigner"]

AUTH_HEADER = "x-swarmtrain-auth"
PEER_HEADER = "x-swarmtrain-peer"
CALL_WINDOW_S = 300.0  # clocks of peers may differ this much; a captured call is refused after it
MAX_REMEMBERED = 200_000  # nonces in one window; past it calls are refused rather than memory growing
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


class CallAuth:
    """The callee's side: `check` accepts a call once or raises CallRefused. Not thread-safe: one event loop."""

    def __init__(self, secret: RunSecret, *, window_s: float = CALL_WINDOW_S,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        if window_s <= 0 or max_remembered <= 0:
            raise ValueError(f"CallAuth: window_s and max_remembered must be > 0, got {window_s}, {max_remembered}")
        self._key = secret.calls
        self.window_s = window_s
        self.max_remembered = max_remembered
        self._seen: set[str] = set()
        self._order: collections.deque[tuple[float, str]] = collections.deque()  # (forget at, nonce)

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
        self._forget(now)
        if nonce in self._seen:
            raise CallRefused("a replayed call (its nonce was already used)")
        if len(self._seen) >= self.max_remembered:
            raise CallRefused(f"more than {self.max_remembered} calls in {self.window_s:.0f}s: refusing until some age out")
        self._seen.add(nonce)
        self._order.append((now + 2 * self.window_s, nonce))

    def _forget(self, now: float) -> None:
        # A nonce is kept until no clock inside the window could still accept its time: 2 windows after now.
        while self._order and self._order[0][0] <= now:
            self._seen.discard(self._order.popleft()[1])
