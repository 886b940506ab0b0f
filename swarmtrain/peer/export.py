"""`swarmtrain peer --export-dir OUT`: the θ_global a peer left with, as a Hugging Face directory."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmtrain.peer.root import Peer

__all__ = ["export_on_leave"]


def export_on_leave(peer: Peer, out: str) -> None:
    """The swarm's weights (θ_global, not the peer's θ_local) written to `out`, announced on stdout as an
    `export` line."""
    from swarmtrain.diloco.flat import assign_flat
    from swarmtrain.sync.export import export_model

    worker = peer.worker
    assert worker is not None
    assign_flat(worker.theta_global.detach().cpu(), worker.params)
    path = export_model(worker.model.cpu(), peer.cfg, out, provenance={"round": worker.round,
                                                                       "hash": worker.global_hash()})
    print(json.dumps({"event": "export", "path": str(path), "round": worker.round}), flush=True)
