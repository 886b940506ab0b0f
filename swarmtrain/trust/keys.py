"""The run key and the keys derived from it; an empty key is refused on an address others can reach."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["RUN_KEY_ENV", "InsecureRunError", "RunSecret", "check_exposure", "resolve_run_key"]

RUN_KEY_ENV = "SWARMTRAIN_RUN_KEY"
_LABEL = b"swarmtrain/v1/"


class InsecureRunError(ValueError):
    """An open run (empty run key) would listen on an address other machines can reach."""


def resolve_run_key(configured: str, *, env: Mapping[str, str] = os.environ) -> str:
    """The run's shared secret: env SWARMTRAIN_RUN_KEY when set, else the configured `rpc.run_key`."""
    return env.get(RUN_KEY_ENV) or configured


@dataclass(frozen=True)
class RunSecret:
    """One key per use, each HMAC-SHA256(run key, label): a MAC made for one use never passes for another,
    and the run key itself never leaves the machine. An empty run key still derives keys (everyone can
    compute them): such a run is open, which `open` says."""

    records: bytes = field(repr=False)
    calls: bytes = field(repr=False)
    tickets: bytes = field(repr=False)
    payloads: bytes = field(repr=False)
    tls: bytes = field(repr=False)
    open: bool

    @classmethod
    def from_run_key(cls, run_key: str) -> RunSecret:
        key = run_key.encode()

        def derive(use: bytes) -> bytes:
            return hmac.new(key, _LABEL + use, hashlib.sha256).digest()

        return cls(records=derive(b"records"), calls=derive(b"calls"), tickets=derive(b"tickets"),
                   payloads=derive(b"payloads"), tls=derive(b"tls-authority"), open=not run_key)

    def fingerprint(self) -> str:
        """A short public name of the key (the same on every holder), for logs and errors: never the key."""
        return hmac.new(self.records, b"fingerprint", hashlib.sha256).hexdigest()[:12]


def _reachable(host: str) -> bool:
    """Whether a listener on `host` can be reached from another machine (anything but loopback)."""
    name = host.strip("[]")
    if name in ("localhost", ""):
        return name == ""  # "" binds every interface
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True  # a host name: assume it resolves to a public address


def check_exposure(secret: RunSecret, hosts: Iterable[str], *, insecure: bool) -> None:
    """Refuse an open run on a reachable address unless the user said `--insecure`."""
    if not secret.open or insecure:
        return
    exposed = sorted({h for h in hosts if _reachable(h)})
    if exposed:
        raise InsecureRunError(
            f"the run key is empty and this process would listen on {', '.join(exposed)}: anyone who reaches it "
            f"could join and steer the run; set {RUN_KEY_ENV} (or rpc.run_key), or pass --insecure")
