"""`swarmtrain generate --checkpoint-dir D --prompt TEXT`: sample a continuation from a checkpoint's model."""

from __future__ import annotations

import argparse
import sys

HELP = "sample text from a checkpoint's model (θ_global) after a prompt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="a peer's checkpoint directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample at most (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = the most likely token (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely (0 = all; default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.data.tokenizer import load_tokenizer
    from swarmtrain.models.generate import generate
    from swarmtrain.sync.export import model_from_checkpoint

    model, cfg, _ = model_from_checkpoint(args.checkpoint_dir)
    text = generate(model, load_tokenizer(cfg.data.tokenizer), args.prompt, max_new_tokens=args.max_new_tokens,
                    context_len=cfg.data.seq_len, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    sys.stdout.write(args.prompt + text + "\n")
    return 0
