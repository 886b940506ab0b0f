"""`rpc.tls`: this node's TLS for gRPC and the bulk port, from the run's authority (trust/tls.py)."""

from __future__ import annotations

import os
import ssl
import tempfile

import grpc

from swarmtrain.trust import RunSecret
from swarmtrain.trust.tls import TLS_NAME, TlsIdentity, tls_identity

__all__ = ["NodeTls", "TlsWithoutKeyError"]


class TlsWithoutKeyError(ValueError):
    """`rpc.tls` asked for on an open run: its certificates come from the run key, so they would prove nothing."""


class NodeTls:
    """TLS credentials of one node: its leaf to serve with, the run's authority to trust."""

    def __init__(self, secret: RunSecret, *, peer_id: str) -> None:
        if secret.open:
            raise TlsWithoutKeyError("rpc.tls needs a run key: the run's TLS certificates are derived from it, and "
                                     "with an empty key anyone could issue them")
        self.identity: TlsIdentity = tls_identity(secret, peer_id=peer_id)
        self.server_context = self._server_context()
        self.client_context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                                         cadata=self.identity.authority_pem.decode())
        self.client_context.minimum_version = ssl.TLSVersion.TLSv1_3
        for ctx in (self.server_context, self.client_context):  # a half-close ends a stream (rpc/links.py)
            ctx.options |= ssl.OP_IGNORE_UNEXPECTED_EOF

    # -- gRPC --------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.identity.key_pem, self.identity.cert_pem)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.identity.authority_pem)

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        """Every leaf is named TLS_NAME whatever address it serves: check that name, not the host's."""
        return [("grpc.ssl_target_name_override", TLS_NAME), ("grpc.default_authority", TLS_NAME)]

    # -- the bulk port -------------------------------------------------------------------------
    server_hostname = TLS_NAME

    def _server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads a key only from a file: a private one, removed as soon as it is read
        with tempfile.TemporaryDirectory(prefix="swarmtrain-tls-") as folder:
            path = os.path.join(folder, "leaf.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.identity.cert_pem + self.identity.key_pem)
            ctx.load_cert_chain(path)
        return ctx
