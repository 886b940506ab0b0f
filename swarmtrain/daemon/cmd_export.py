"""`swarmtrain export --checkpoint-dir D --out OUT`: a checkpoint's θ_global as a Hugging Face directory."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmtrain.roles.worker import Peer

HELP = "write a checkpoint's model as a Hugging Face directory (config.json, model.safetensors, tokenizer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="a peer's checkpoint directory")
    parser.add_argument("--out", required=True, metavar="OUT", help="the directory to create (must not exist)")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.sync.export import export_checkpoint

    out = export_checkpoint(args.checkpoint_dir, args.out)
    print(json.dumps({"export": str(out)}), file=sys.stdout)
    return 0


def export_on_leave(peer: Peer, out: str) -> None:
    """`swarmtrain peer --export-dir OUT`: the θ_global the peer left with (the swarm's weights, not its θ_local)
    as a Hugging Face directory, announced on stdout as an `export` line."""
    from swarmtrain.diloco.flat import assign_flat
    from swarmtrain.sync.export import export_model

    worker = peer.worker
    assert worker is not None
    assign_flat(worker.theta_global.detach().cpu(), worker.params)
    path = export_model(worker.model.cpu(), peer.cfg, out, provenance={"round": worker.round,
                                                                       "hash": worker.global_hash()})
    print(json.dumps({"event": "export", "path": str(path), "round": worker.round}), flush=True)
