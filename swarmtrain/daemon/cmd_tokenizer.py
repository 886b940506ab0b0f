"""`swarmtrain tokenizer train`: a byte-level BPE tokenizer.json trained on local files (no hub)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "train a byte-level BPE tokenizer (tokenizer.json, for data.tokenizer) on local text/jsonl/parquet files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["train"], help="train: a new tokenizer from INPUTS")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, .jsonl, .parquet or saved datasets directories (as `data prepare` reads)")
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="tokens, the end-of-text one included (default 8192)")
    parser.add_argument("--field", default="text",
                        help="the text field of .jsonl/.parquet/datasets inputs (default text)")
    parser.add_argument("--split", default="train", help="the split of a saved DatasetDict (default train)")
    parser.add_argument("--min-frequency", type=int, default=2, help="merges seen fewer times are not learned")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.data.readers import iter_texts
    from swarmtrain.data.tokenizer_train import train_bpe

    size = train_bpe(iter_texts(args.inputs, field=args.field, split=args.split), vocab_size=args.vocab_size,
                     out=args.out, min_frequency=args.min_frequency)
    print(json.dumps({"tokenizer": args.out, "vocab_size": size}), file=sys.stdout)
    return 0
