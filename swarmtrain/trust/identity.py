"""Peer identity keys: signing what a voter grants with the key its peer id is derived from, and checking
such a signature and that the key is the peer's own (pure, `cryptography` only; the DHT adapter hands over
the libp2p key).

Two key types, tagged in their public bytes: `rsa:` + DER (a real peer: its libp2p identity, whose peer id
is base58(multihash(sha2-256(protobuf(key)))), so any peer checks the binding from the id alone) and
`ed25519:` + the raw key (the in-process twins of the DHT, whose ids are handed out by a registry that
knows which key each id has). The shared run key proves membership; these keys prove *who*: a grant signed
here cannot be made by another key holder of the run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

__all__ = [
    "Ed25519Identity",
    "Identity",
    "KeyBinding",
    "RsaIdentity",
    "libp2p_peer_id",
    "registry_binding",
    "self_certifying",
    "verifier",
    "verify_signature",
]

RSA_TAG, ED25519_TAG = b"rsa:", b"ed25519:"
# The padding hivemind signs DHT records with (so one key signs both the same way).
_RSA_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class Identity(Protocol):
    """A peer's signing key: `public_key` is tagged (see the module docstring)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def public_key(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


KeyBinding = Callable[[str, bytes], bool]
"""(peer_id, public_key) -> whether `public_key` is the key of `peer_id`."""


@dataclass(frozen=True)
class Ed25519Identity:
    peer_id: str
    key: ed25519.Ed25519PrivateKey

    @classmethod
    def generate(cls, peer_id: str) -> Ed25519Identity:
        return cls(peer_id, ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, peer_id: str, seed: bytes) -> Ed25519Identity:
        """A deterministic key (simulations replay a seed exactly)."""
        return cls(peer_id, ed25519.Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    @property
    def public_key(self) -> bytes:
        raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return ED25519_TAG + raw

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


@dataclass(frozen=True)
class RsaIdentity:
    peer_id: str
    key: rsa.RSAPrivateKey

    @classmethod
    def from_der(cls, der: bytes) -> RsaIdentity:
        """From a libp2p identity's DER private key; the peer id is derived from it."""
        key = serialization.load_der_private_key(der, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("identity: not an RSA key")
        public = RSA_TAG + key.public_key().public_bytes(serialization.Encoding.DER,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo)
        peer_id = libp2p_peer_id(public)
        assert peer_id is not None
        return cls(peer_id, key)

    @property
    def public_key(self) -> bytes:
        return RSA_TAG + self.key.public_key().public_bytes(serialization.Encoding.DER,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo)

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message, _RSA_PADDING, hashes.SHA256())


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public_key`'s over `message` (a malformed key is simply False)."""
    try:
        if public_key.startswith(ED25519_TAG):
            ed25519.Ed25519PublicKey.from_public_bytes(public_key[len(ED25519_TAG):]).verify(signature, message)
            return True
        if public_key.startswith(RSA_TAG):
            key = serialization.load_der_public_key(public_key[len(RSA_TAG):])
            if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192:
                return False
            key.verify(signature, message, _RSA_PADDING, hashes.SHA256())
            return True
    except (InvalidSignature, ValueError, TypeError):
        return False
    return False


def _b58(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, rem = divmod(n, 58)
        out = _B58[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def libp2p_peer_id(public_key: bytes) -> str | None:
    """libp2p's peer id of an `rsa:` key (None for other keys): base58 of the sha2-256 multihash of the
    protobuf PublicKey {Type: RSA, Data: DER}."""
    if not public_key.startswith(RSA_TAG):
        return None
    der = public_key[len(RSA_TAG):]
    length, varint = len(der), b""
    while True:
        byte, length = length & 0x7F, length >> 7
        varint += bytes([byte | (0x80 if length else 0)])
        if not length:
            break
    wrapped = b"\x08\x00\x12" + varint + der
    return _b58(b"\x12\x20" + hashlib.sha256(wrapped).digest())


def self_certifying(peer_id: str, public_key: bytes) -> bool:
    """The binding of real peers: the id is the libp2p id of the key."""
    return libp2p_peer_id(public_key) == peer_id


def registry_binding(keys: Mapping[str, bytes]) -> KeyBinding:
    """The binding of the in-process twins: a registry's id -> key table (and real ids still self-certify)."""
    return lambda peer_id, public_key: keys.get(peer_id) == public_key or self_certifying(peer_id, public_key)


def verifier(binding: KeyBinding) -> Callable[[str, bytes, bytes, bytes], bool]:
    """The `round.certificate.Verify` of a binding: the key is the peer's, and it signed the message."""

    def verify(peer_id: str, public_key: bytes, message: bytes, signature: bytes) -> bool:
        return binding(peer_id, public_key) and verify_signature(public_key, message, signature)

    return verify


class IdentityError(ValueError):
    """A key cannot be used as a peer identity."""
