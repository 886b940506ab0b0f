"""`swarmtrain export --checkpoint-dir D --out OUT`: a checkpoint's θ_global as a Hugging Face directory."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "write a checkpoint's model as a Hugging Face directory (config.json, model.safetensors, tokenizer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="a peer's checkpoint directory")
    parser.add_argument("--out", required=True, metavar="OUT", help="the directory to create (must not exist)")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.sync.export import export_checkpoint

    out = export_checkpoint(args.checkpoint_dir, args.out)
    print(json.dumps({"export": str(out)}), file=sys.stdout)
    return 0
