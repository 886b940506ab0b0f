"""trust/tls.py: every holder of a run key derives one authority; leaves it signs verify against it and
no other; a leaf is fresh per process."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from swarmtrain.trust import RunSecret
from swarmtrain.trust.tls import TLS_NAME, authority_key, tls_identity

pytestmark = pytest.mark.unit


def _public(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_every_holder_derives_the_same_authority_and_another_key_another() -> None:
    a, b, other = (RunSecret.from_run_key(k) for k in ("k1", "k1", "k2"))
    assert _public(authority_key(a)) == _public(authority_key(b)) != _public(authority_key(other))
    # Two holders' authority certificates differ in their signatures only: same name, same key.
    ca_a = x509.load_pem_x509_certificate(tls_identity(a, peer_id="p").authority_pem)
    ca_b = x509.load_pem_x509_certificate(tls_identity(b, peer_id="q").authority_pem)
    assert ca_a.subject == ca_b.subject and ca_a.public_key() == ca_b.public_key()


def test_a_leaf_verifies_against_its_runs_authority_only() -> None:
    secret, other = RunSecret.from_run_key("k1"), RunSecret.from_run_key("k2")
    ident = tls_identity(secret, peer_id="peer-1")
    leaf = x509.load_pem_x509_certificate(ident.cert_pem)
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(tls_identity(secret, peer_id="x").authority_pem))
    stranger = x509.load_pem_x509_certificate(tls_identity(other, peer_id="x").authority_pem)
    with pytest.raises((ValueError, InvalidSignature)):
        leaf.verify_directly_issued_by(stranger)
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [TLS_NAME]
    assert ident.key_pem not in repr(ident).encode() and b"PRIVATE KEY" in ident.key_pem


def test_each_process_gets_a_fresh_leaf() -> None:
    secret = RunSecret.from_run_key("k1")
    one, two = tls_identity(secret, peer_id="p"), tls_identity(secret, peer_id="p")
    assert one.key_pem != two.key_pem and one.fingerprint() != two.fingerprint()
