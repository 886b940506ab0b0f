"""Run membership: what proves that a record, a call or a transfer comes from a holder of the run key.

Pure (no I/O, no sockets, no clock of its own; times are passed in), so every check is tested by hand.

keys.py   the run key (env or config), the per-use keys derived from it, the refusal of an open run on a
          public address
calls.py  a MAC per gRPC call over (method, caller, callee, time, nonce) and the replay guard that checks it
seal.py   a MAC on every control-plane record, bound to its DHT key and signer
payloads.py  MACs on data-plane payloads (state headers, bulk transfers)
identity.py  peer identity keys: what a voter grants, signed with the key its peer id comes from
tls.py    TLS certificates of a run: an authority derived from the run key, a fresh leaf per process
"""

from swarmtrain.trust.calls import CallAuth, CallRefused, CallSigner
from swarmtrain.trust.keys import RUN_KEY_ENV, InsecureRunError, RunSecret, check_exposure, resolve_run_key
from swarmtrain.trust.payloads import check_payload_mac, payload_mac
from swarmtrain.trust.seal import SealError, open_sealed, seal

__all__ = [
    "RUN_KEY_ENV",
    "CallAuth",
    "CallRefused",
    "CallSigner",
    "InsecureRunError",
    "RunSecret",
    "SealError",
    "check_exposure",
    "check_payload_mac",
    "open_sealed",
    "payload_mac",
    "resolve_run_key",
    "seal",
]
