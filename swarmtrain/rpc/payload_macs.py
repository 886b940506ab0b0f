"""Payload MACs and digests (trust/payloads.py) on the node's event loop: big payloads are hashed in a thread,
so the loop keeps serving while a shard or mean is hashed."""

from __future__ import annotations

import asyncio

from swarmtrain.trust.payloads import check_payload_mac, payload_digest, payload_mac

__all__ = ["digest_of", "mac_of", "mac_ok"]

_OFF_LOOP_BYTES = 1 << 20  # payloads past this are hashed in a thread

Buffer = bytes | bytearray | memoryview


async def digest_of(data: Buffer) -> bytes:
    """`payload_digest(data)`, off the loop when `data` is big."""
    if memoryview(data).nbytes > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(payload_digest, data)
    return payload_digest(data)


async def mac_of(key: bytes, kind: bytes, context: bytes, data: Buffer) -> bytes:
    """`payload_mac(key, kind, context, data)`, off the loop when `data` is big."""
    if memoryview(data).nbytes > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(payload_mac, key, kind, context, data)
    return payload_mac(key, kind, context, data)


async def mac_ok(key: bytes, mac: bytes, kind: bytes, context: bytes, data: Buffer) -> bool:
    """Whether `mac` is `mac_of(key, kind, context, data)`."""
    if memoryview(data).nbytes > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(check_payload_mac, key, mac, kind, context, data)
    return check_payload_mac(key, mac, kind, context, data)
