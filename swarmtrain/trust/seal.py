"""A MAC by the run key on every control-plane record, bound to the DHT key it is stored under and its signer.

The DHT's RSA signature proves who wrote a record; the seal proves that the writer holds the run key,
so an outsider who can reach the DHT (the run id is public) cannot publish records the swarm reads.
Binding the DHT key stops a member's record being replayed under another key (another round, run or kind).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["SEAL_PREFIX", "SealError", "open_sealed", "seal"]

SEAL_PREFIX = b"STS1"
_MAC_BYTES = 32


class SealError(ValueError):
    """A record without a valid seal: written by someone without the run key, or altered."""


def _mac(key: bytes, dht_key: str, signer_id: str, body: bytes) -> bytes:
    h = hmac.new(key, dht_key.encode() + b"\0" + signer_id.encode() + b"\0", hashlib.sha256)
    h.update(body)
    return h.digest()


def seal(key: bytes, *, dht_key: str, signer_id: str, body: bytes) -> bytes:
    """`body` as stored: prefix, MAC, body."""
    return SEAL_PREFIX + _mac(key, dht_key, signer_id, body) + body


def open_sealed(key: bytes, value: object, *, dht_key: str, signer_id: str) -> bytes:
    """The body of a sealed value, or SealError saying why it is not one of this run's."""
    if not isinstance(value, (bytes, bytearray)):
        raise SealError(f"expected bytes, got {type(value).__name__}")
    data = bytes(value)
    if not data.startswith(SEAL_PREFIX) or len(data) < len(SEAL_PREFIX) + _MAC_BYTES:
        raise SealError("not sealed by the run key (written by a peer of an older version or of no run)")
    mac, body = data[len(SEAL_PREFIX):len(SEAL_PREFIX) + _MAC_BYTES], data[len(SEAL_PREFIX) + _MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, dht_key, signer_id, body)):
        raise SealError("sealed with another run key (a peer of another run, or an altered record)")
    return body
