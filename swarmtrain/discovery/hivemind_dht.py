"""HivemindDiscovery: Discovery over one hivemind.DHT per peer, every record in an RSA owner-signed subkey.

Identity: one RSA key is both the libp2p identity (so the peer id in a multiaddr is the hash of
it) and the record-signing key. A record's signer id is therefore derived from the public key in
its subkey, and a record claiming another peer's id is rejected on decode. The DHT nodes
themselves refuse unsigned subkeys and signatures that do not match the subkey's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import logging
import os
import re
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as torch_mp

_SHARING_STRATEGY = torch_mp.get_sharing_strategy()
# `import hivemind` switches torch's sharing strategy to file_system process-wide; undo that.
import base58  # noqa: E402 - a hivemind dependency, imported after the strategy is saved
from cryptography.exceptions import UnsupportedAlgorithm  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from hivemind import DHT  # noqa: E402
from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.dht.node import DHTNode  # noqa: E402
from hivemind.dht.validation import DHTRecord, RecordValidatorBase  # noqa: E402
from hivemind.p2p import PeerID  # noqa: E402
from hivemind.proto import crypto_pb2  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402
from hivemind.utils.mpfuture import MPFuture  # noqa: E402
from hivemind.utils.timed_storage import get_dht_time  # noqa: E402

torch_mp.set_sharing_strategy(_SHARING_STRATEGY)

from swarmtrain.config import ConfigError, DiscoveryConfig  # noqa: E402
from swarmtrain.discovery.protocol import DiscoveryError, RawSlot, RecordDirectory  # noqa: E402
from swarmtrain.proctree import open_tree  # noqa: E402
from swarmtrain.trust.identity import Identity, KeyBinding, RsaIdentity, self_certifying  # noqa: E402

__all__ = ["CLOSE_MARGIN_S", "HivemindDiscovery", "signer_id_of"]

log = logging.getLogger(__name__)
STORE_ATTEMPTS = 3  # a store no node accepted is retried: seen transiently with hivemind 1.1 under load
STORE_BACKOFF_S = 0.1
_OWNER_RE = re.compile(rb"\[owner:(.+?)\]")
# Closing a DHT: asked for `discovery.shutdown_timeout_s`, then SIGTERM for TERM_GRACE_S, then SIGKILL (to
# it and its p2pd) and KILL_WAIT_S for the kernel to finish them. SIGTERM rarely helps: the DHT process
# inherits its daemon's Python SIGTERM handler through fork, and that handler leaves a forked child running.
TERM_GRACE_S = 1.0
KILL_WAIT_S = 2.0
CLOSE_MARGIN_S = TERM_GRACE_S + KILL_WAIT_S  # aclose() returns within discovery.shutdown_timeout_s + this
_OPEN: weakref.WeakSet[HivemindDiscovery] = weakref.WeakSet()  # this process's started DHT nodes
_starting = 0  # DHT nodes of this process being started (not in _OPEN yet)


def _fresh_futures_if_no_dht_is_open() -> None:
    """hivemind's MPFuture: every DHT process forked from this one reports to it through one pipe guarded by
    one process-shared lock, made once per process. A DHT killed mid-report (a forced stop) leaves that
    lock taken for good, and every DHT this process starts afterwards would come up but never be heard
    from. When no DHT of this process is open, nothing uses them any more: start the next one afresh."""
    if not _starting and not any(not d._closed for d in _OPEN):
        MPFuture.reset_backend()


def _peer_id_of_public_key(ssh_public_key: bytes) -> str:
    """libp2p's peer id of an RSA key: base58(multihash sha2-256 of the protobuf-wrapped DER key)."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    der = key.public_bytes(encoding=serialization.Encoding.DER,
                           format=serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(wrapped).digest()).decode()


def signer_id_of(subkey: object) -> str | None:
    """The peer id that owns a subkey (`[owner:<ssh-rsa key>]`), or None if it names no valid key."""
    if not isinstance(subkey, bytes):
        return None
    keys = _OWNER_RE.findall(subkey)
    if len(keys) != 1:
        return None
    try:
        return _peer_id_of_public_key(keys[0])
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None


class _OwnerRequiredValidator(RecordValidatorBase):
    """Refuses any record whose key and subkey carry no owner key: a swarmtrain DHT holds signed records only."""

    def validate(self, record: DHTRecord) -> bool:
        if RSASignatureValidator.PUBLIC_KEY_FORMAT[:7] in record.key + record.subkey:  # b"[owner:"
            return True
        log.warning("DHT refused an unsigned record (subkey %r, %d value bytes)", record.subkey[:40], len(record.value))
        return False

    @property
    def priority(self) -> int:
        return 20  # before the signature check, which lets unprotected records through

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, _OwnerRequiredValidator)


class _LoggingSignatureValidator(RSASignatureValidator):
    """hivemind's RSA owner-signature check, with rejections logged at WARNING instead of DEBUG."""

    def validate(self, record: DHTRecord) -> bool:
        ok = super().validate(record)
        if not ok:
            log.warning("DHT refused a record with a missing or forged owner signature (subkey %r)",
                        record.subkey[:60])
        return ok


def _load_or_create_identity(path: Path) -> RSAPrivateKey:
    """Read (or create, mode 0400) a libp2p identity file: a protobuf PrivateKey holding RSA DER."""
    if path.exists():
        try:
            msg = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        except (OSError, DecodeError) as e:
            raise ConfigError(f"discovery.identity_path: cannot read a libp2p identity from {path}: {e}") from e
        if msg.key_type != crypto_pb2.RSA:
            raise ConfigError(f"discovery.identity_path: {path} holds a non-RSA key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": msg.data})  # hivemind's own (pickle) way to load DER
        return key
    if not path.parent.is_dir():
        raise ConfigError(f"discovery.identity_path: directory {path.parent} does not exist")
    key = RSAPrivateKey()
    msg = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes())
    path.write_bytes(msg.SerializeToString())
    path.chmod(0o400)
    return key


def dht_kwargs(cfg: DiscoveryConfig) -> dict[str, Any]:
    """hivemind.DHT/P2P keyword arguments for a DiscoveryConfig (listening address, NAT options)."""
    proto = "ip6" if ":" in cfg.host else "ip4"
    kwargs: dict[str, Any] = {
        "host_maddrs": [f"/{proto}/{cfg.host}/tcp/{cfg.port}"],
        "client_mode": cfg.client_mode,
        "nat_port_map": cfg.nat_port_map,
        "use_auto_relay": cfg.use_auto_relay,
        "use_ipfs": False,
    }
    if cfg.announce_maddrs:
        kwargs["announce_maddrs"] = list(cfg.announce_maddrs)
    return kwargs


class HivemindDiscovery(RecordDirectory):
    """One peer's DHT node. Build with `await HivemindDiscovery.create(cfg, run_id=...)`; `aclose()` stops it."""

    def __init__(self, dht: DHT, key: RSAPrivateKey, *, run_id: str, record_ttl_s: float,
                 shutdown_timeout_s: float = 5.0, run_key: str = "") -> None:
        super().__init__(run_id=run_id, record_ttl_s=record_ttl_s, clock=get_dht_time, run_key=run_key)
        self._dht = dht
        self._shutdown_timeout_s = shutdown_timeout_s
        # Set by aclose: the DHT process's is_alive() can read True for a moment after it was reaped by
        # hivemind's shutdown thread, and a call then would hit the closed pipe instead of this error.
        self._closed = False
        self._owner = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())
        self._peer_id = dht.peer_id.to_base58()
        derived = signer_id_of(self._owner)
        assert derived == self._peer_id, f"signing key ({derived}) is not the libp2p identity ({self._peer_id})"
        # The same key signs what this peer's voters grant (trust/identity.py): its id proves whose grant it is.
        self._identity = RsaIdentity.from_der(key.to_bytes())
        assert self._identity.peer_id == self._peer_id
        self._expiry: dict[str, float] = {}

    @classmethod
    async def create(cls, cfg: DiscoveryConfig, *, run_id: str, run_key: str = "",
                     start_timeout_s: float = 60.0) -> HivemindDiscovery:
        """Start a DHT node (a forked process with Go p2pd, ~2 s) and join `cfg.initial_peers`; records are
        sealed and read with `run_key` (see RecordDirectory)."""
        with tempfile.TemporaryDirectory(prefix="swarmtrain-id-") as tmp:
            fresh = not cfg.identity_path
            path = Path(tmp) / "identity.key" if fresh else Path(cfg.identity_path)
            key = _load_or_create_identity(path)
            validators = [_LoggingSignatureValidator(key), _OwnerRequiredValidator()]
            global _starting
            _fresh_futures_if_no_dht_is_open()
            _starting += 1
            try:
                # hivemind's "is this identity taken?" probe starts a throwaway p2pd with its default
                # nat_port_map=True (a UPnP/NAT-PMP probe of the gateway), which we never allow; a second
                # live process with the same identity is instead prevented by the checkpoint-dir lock.
                dht = DHT(initial_peers=list(cfg.initial_peers) or None, start=False, record_validators=validators,
                          identity_path=str(path), check_if_identity_free=False, **dht_kwargs(cfg))
                # hivemind forks the DHT process from ours, which already runs grpc/torch threads; a child
                # GC pass over objects inherited mid-mutation segfaulted here. Frozen objects are never
                # collected, in the child either (the stdlib's recommended guard around fork).
                gc.freeze()
                try:
                    dht.run_in_background(await_ready=False)
                finally:
                    gc.unfreeze()
                try:
                    await asyncio.wait_for(asyncio.to_thread(dht.wait_until_ready, start_timeout_s),
                                           timeout=start_timeout_s + 1)
                except BaseException as e:
                    await _stop_dht(dht, name="(starting)", grace_s=cfg.shutdown_timeout_s)
                    raise DiscoveryError(f"DHT did not start within {start_timeout_s:.0f}s: {e!r}") from e
                peer_id = await asyncio.to_thread(lambda: dht.peer_id)
            finally:
                _starting -= 1  # no await until it is in _OPEN: no other start sees neither
        self = cls(dht, key, run_id=run_id, record_ttl_s=cfg.record_ttl_s,
                   shutdown_timeout_s=cfg.shutdown_timeout_s, run_key=run_key)
        _OPEN.add(self)
        log.info("DHT %s up at %s", peer_id, [str(a) for a in await self.visible_maddrs()])
        return self

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def key_binding(self) -> KeyBinding:
        return self_certifying

    @property
    def dht(self) -> DHT:
        """The underlying node, for tests that play a hostile peer."""
        return self._dht

    @property
    def owner_subkey(self) -> bytes:
        return self._owner

    async def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<peer id>) that others pass as `initial_peers`."""
        maddrs = await asyncio.to_thread(self._dht.get_visible_maddrs)
        return [str(m) for m in maddrs]

    async def _wait(self, future: Any, what: str, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(future, timeout=timeout_s)
        except TimeoutError as e:
            future.cancel()
            raise DiscoveryError(f"DHT {what} did not finish within {timeout_s:.2f}s") from e

    async def _put(self, key: str, value: bytes, *, expires_at: float, timeout_s: float) -> None:
        if self._closed or not self._dht.is_alive():
            raise DiscoveryError(f"DHT of {self._peer_id} is not running")
        deadline = time.monotonic() + timeout_s
        for attempt in range(STORE_ATTEMPTS):
            # hivemind keeps the value with the later expiration: never let a refresh (or a retry of a
            # store some nodes already took) lose to an older one.
            expires_at = max(expires_at, self._expiry.get(key, 0.0) + 1e-3)
            future = self._dht.store(key, value, expiration_time=expires_at, subkey=self._owner, return_future=True)
            ok = await self._wait(future, f"store of {key}", max(deadline - time.monotonic(), 1e-3))
            self._expiry[key] = expires_at
            if ok:
                return
            delay_s = STORE_BACKOFF_S * 2**attempt
            if time.monotonic() + delay_s >= deadline:
                break
            log.info("DHT refused to store %s (attempt %d); retrying in %.2fs", key, attempt + 1, delay_s)
            await asyncio.sleep(delay_s)
        raise DiscoveryError(f"DHT refused to store {key} (no reachable node accepted it)")

    async def _get(self, key: str, *, timeout_s: float) -> Sequence[RawSlot]:
        if self._closed or not self._dht.is_alive():
            raise DiscoveryError(f"DHT of {self._peer_id} is not running")
        found = await self._wait(self._dht.get(key, latest=True, return_future=True), f"get of {key}", timeout_s)
        if found is None or not isinstance(found.value, dict):
            return []
        return [RawSlot(signer_id=signer_id_of(subkey), value=item.value, expires_at=item.expiration_time)
                for subkey, item in found.value.items()]

    async def _delete(self, key: str, *, timeout_s: float) -> None:
        # A DHT cannot delete: overwrite our slot with an empty tombstone that outlives the record.
        if key in self._expiry:
            await self._put(key, b"", expires_at=self._expiry[key] + 1e-3, timeout_s=timeout_s)

    async def rebootstrap(self, maddrs: Sequence[str], *, timeout_s: float) -> int:
        """Dial `maddrs` again, ping each into the routing table and look up this node's neighbours.

        hivemind bootstraps once, at start. A node whose links all dropped (frozen past every peer's
        timeout, a network change, a long partition) keeps an empty routing table and finds nobody,
        however long it waits; this is how it finds the swarm again."""
        if self._closed or not self._dht.is_alive():
            raise DiscoveryError(f"DHT of {self._peer_id} is not running")
        for text in maddrs:
            _peer_id_in(text)  # refuse a malformed address here, with its text, not in the DHT process
        future = self._dht.run_coroutine(functools.partial(_rebootstrap, maddrs=tuple(maddrs)), return_future=True)
        return int(await self._wait(future, "re-bootstrap", timeout_s))

    async def aclose(self) -> None:
        """Stop the DHT node within `discovery.shutdown_timeout_s` + CLOSE_MARGIN_S; killed if it hangs."""
        self._closed = True
        await _stop_dht(self._dht, name=self._peer_id, grace_s=self._shutdown_timeout_s)
        log.info("DHT %s stopped (pid %s)", self._peer_id, os.getpid())


def _peer_id_in(maddr: str) -> PeerID:
    from hivemind.utils.multiaddr import Multiaddr

    try:
        return PeerID.from_base58(Multiaddr(maddr)["p2p"])
    except Exception as e:
        raise ConfigError(f"discovery.initial_peers: {maddr!r} is not a multiaddr ending in /p2p/<peer id> ({e})") \
            from e


async def _rebootstrap(_dht: DHT, node: DHTNode, *, maddrs: tuple[str, ...]) -> int:
    """Runs inside the DHT process (DHT.run_coroutine): dial, ping, then refresh the neighbourhood."""
    from hivemind.utils.multiaddr import Multiaddr

    by_peer: dict[PeerID, list[Multiaddr]] = {}
    for text in maddrs:
        peer_id = _peer_id_in(text)  # the daemon dials the transport address, without its /p2p/ part
        by_peer.setdefault(peer_id, []).append(Multiaddr(text).decapsulate(Multiaddr(f"/p2p/{peer_id}")))
    answered = 0
    for peer_id, addrs in by_peer.items():
        if peer_id == node.peer_id:
            continue
        try:
            await node.p2p._client.connect(peer_id, addrs)  # the daemon may have dropped its addresses
        except Exception as e:
            log.warning("re-bootstrap: could not dial %s: %s", peer_id, e)
            continue
        if await node.protocol.call_ping(peer_id) is not None:  # adds it to the routing table
            answered += 1
    if answered:
        await node.find_nearest_nodes([node.node_id])
    return answered


async def _stop_dht(dht: DHT, *, name: str, grace_s: float) -> None:
    """Ask the DHT process to stop; SIGTERM it after `grace_s`, SIGKILL it and its p2pd TERM_GRACE_S later.

    Returns within `grace_s` + CLOSE_MARGIN_S whatever the process does (stopped, deadlocked), and never
    leaves it running: a cancelled close kills it before re-raising. The process is reaped, so the
    interpreter's exit (which joins live multiprocessing children without a timeout) cannot hang on it.
    """
    tree = open_tree(dht.pid) if dht.pid is not None and dht.is_alive() else []
    if not tree:
        return
    # p2pd is captured now: a killed DHT process orphans it. hivemind's shutdown() blocks (a pipe send, a
    # join); it runs on a daemon thread so a hung one holds neither the event loop nor the interpreter's
    # exit, and with a timeout past ours its own terminate() never races our escalation.
    dht.shutdown_timeout = grace_s + CLOSE_MARGIN_S + 1.0
    threading.Thread(target=dht.shutdown, name=f"dht-shutdown-{name[:12]}", daemon=True).start()
    proc, p2pd = tree[0], tree[1:]
    forced: list[str] = []
    try:
        if not await proc.wait(grace_s):
            forced.append("SIGTERM")
            proc.send(signal.SIGTERM)
            if not await proc.wait(TERM_GRACE_S):
                forced.append("SIGKILL")
                proc.send(signal.SIGKILL)
        orphans = [p for p in p2pd if not p.exited()]  # a DHT that stopped by itself stopped its p2pd first
        for p in orphans:
            p.send(signal.SIGKILL)
        if orphans:
            forced.append(f"SIGKILL to p2pd (pid {', '.join(str(p.pid) for p in orphans)})")
        deadline = time.monotonic() + KILL_WAIT_S
        for p in tree:
            await p.wait(deadline - time.monotonic())
        running = [p.pid for p in tree if not p.exited()]
    except BaseException:
        for p in tree:
            p.send(signal.SIGKILL)
        raise
    finally:
        with contextlib.suppress(ValueError, AssertionError):
            dht.join(timeout=0)  # reaps the exited process (unless the shutdown thread already has)
        for p in tree:
            p.close()
    if forced or running:
        log.warning("DHT %s (pid %d) did not stop within %.1fs of being asked: forced %s; %s", name, proc.pid,
                    grace_s, ", ".join(forced), f"still running: {running}" if running else "all gone")
