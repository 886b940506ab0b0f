"""The typed errors of the data plane: what a failed call raises (RpcError family) and what a service raises
to refuse (Rejected)."""

from __future__ import annotations

__all__ = ["Rejected", "RpcError", "RpcRejected", "RpcTimeout", "RpcUnavailable", "status_name"]


class RpcError(Exception):
    """A call to another peer failed; subclasses say whether retrying can help."""


class RpcUnavailable(RpcError):
    """The peer could not be reached (refused, reset, shut down): retry or treat it as dead."""


class RpcTimeout(RpcError):
    """The call's deadline passed."""


class RpcRejected(RpcError):
    """The peer answered and refused the request; `code` is the gRPC status name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Rejected(ValueError):
    """Raised by a service implementation to refuse a request; the servicer maps `kind` to a status."""

    KINDS = ("invalid", "precondition", "not_found", "too_large", "aborted")

    def __init__(self, message: str, *, kind: str = "invalid") -> None:
        assert kind in self.KINDS, kind
        super().__init__(message)
        self.kind = kind


_KIND_NAMES = {"invalid": "INVALID_ARGUMENT", "precondition": "FAILED_PRECONDITION", "not_found": "NOT_FOUND",
               "too_large": "RESOURCE_EXHAUSTED", "aborted": "ABORTED"}


def status_name(rejected: Rejected) -> str:
    """The gRPC status name a refusal is answered with (on the bulk port too)."""
    return _KIND_NAMES[rejected.kind]
