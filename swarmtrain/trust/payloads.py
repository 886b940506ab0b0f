"""MACs on what the data plane carries (state headers, bulk payloads): a man in the middle cannot alter them
unseen, and a peer without the run key cannot produce them."""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["MAC_BYTES", "check_payload_mac", "payload_mac"]

MAC_BYTES = 32
Part = bytes | bytearray | memoryview | str | int


def payload_mac(key: bytes, *parts: Part) -> bytes:
    """HMAC-SHA256 under `key` of `parts`, each length-prefixed (no two lists of parts give one message).
    hashlib reads large buffers without holding the GIL; run it off an event loop for big payloads."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        raw: bytes | bytearray | memoryview
        if isinstance(part, str):
            raw = part.encode()
        elif isinstance(part, int):
            raw = str(part).encode()
        else:
            raw = part
        h.update(memoryview(raw).nbytes.to_bytes(8, "big"))
        h.update(raw)
    return h.digest()


def check_payload_mac(key: bytes, mac: bytes, *parts: Part) -> bool:
    """Whether `mac` is `payload_mac(key, *parts)` (constant-time compare)."""
    return hmac.compare_digest(mac, payload_mac(key, *parts))
