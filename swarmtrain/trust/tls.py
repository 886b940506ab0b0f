"""TLS certificates of a run: an authority derived from the run key, and a fresh leaf per process.

Every holder of the run key derives the same authority key (an ECDSA P-256 scalar from the run's
`tls` key) and so trusts exactly the certificates that some holder of the run key issued. Each
process makes its own leaf key when it starts and signs its leaf with the authority; callers trust
the authority alone, under the fixed name TLS_NAME (endpoints are bare addresses, so a host name
would prove nothing more). Nobody without the run key can present a certificate a peer accepts, so
nobody without it can read or alter a TLS connection; a holder of the key can (as it can already
forge payload MACs: docs/security.md).

No certificate files, no fingerprints to distribute: the records that name an endpoint need not
change, and a restarted peer with a new leaf is trusted at once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmtrain.trust.keys import RunSecret

__all__ = ["TLS_NAME", "TlsIdentity", "authority_key", "tls_identity"]

TLS_NAME = "swarmtrain-peer"  # the one name every leaf carries and every caller expects
_CURVE = ec.SECP256R1()
_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # of P-256
_NOT_BEFORE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # fixed: every holder builds the same authority
_NOT_AFTER = dt.datetime(2200, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class TlsIdentity:
    """What one process needs for TLS: the run's authority (to trust) and its own leaf (to present), PEM."""

    authority_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def fingerprint(self) -> str:
        """SHA-256 of this process's leaf certificate (DER), hex: names it in logs."""
        der = x509.load_pem_x509_certificate(self.cert_pem).public_bytes(serialization.Encoding.DER)
        return hashlib.sha256(der).hexdigest()


def authority_key(secret: RunSecret) -> ec.EllipticCurvePrivateKey:
    """The run's authority key: the same for every holder of the run key, a scalar in [1, n-1]."""
    scalar = 1 + int.from_bytes(hashlib.sha512(secret.tls).digest(), "big") % (_ORDER - 1)
    return ec.derive_private_key(scalar, _CURVE)


def _authority_name(secret: RunSecret) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmtrain run {secret.fingerprint()}")])


def _authority_cert(secret: RunSecret, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = _authority_name(secret)
    public = key.public_key()
    serial = 1 + int.from_bytes(hashlib.sha256(secret.tls + b"serial").digest()[:16], "big")
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(serial).not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))


def tls_identity(secret: RunSecret, *, peer_id: str, leaf_key: ec.EllipticCurvePrivateKey | None = None) -> TlsIdentity:
    """The authority of `secret`'s run and a leaf for this process (a fresh key unless `leaf_key`),
    signed by that authority, named TLS_NAME, with `peer_id` in its subject for logs."""
    authority = authority_key(secret)
    leaf = leaf_key or ec.generate_private_key(_CURVE)
    ca_public = authority.public_key()
    serial = x509.random_serial_number()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME),
                                     x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, peer_id[:64] or "?")]))
            .issuer_name(_authority_name(secret)).public_key(leaf.public_key())
            .serial_number(serial).not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False)
            .sign(authority, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsIdentity(
        authority_pem=_authority_cert(secret, authority).public_bytes(pem),
        cert_pem=cert.public_bytes(pem),
        key_pem=leaf.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
