"""`swarmtrain data prepare`: text/jsonl/parquet/datasets inputs -> token shards a run reads from disk."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "tokenize text, .jsonl, .parquet or saved datasets directories into token shards (data.shards)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["prepare"], help="prepare: INPUTS -> shards in --out")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files (any name), .jsonl (a JSON object a line), .parquet, or directories "
                             "saved by datasets' save_to_disk")
    parser.add_argument("--out", required=True, help="the shard directory to create (must not exist)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes (default) or a tokenizer file: tokenizer.json, SentencePiece .model, .tiktoken")
    parser.add_argument("--field", default="text",
                        help="the text field of .jsonl/.parquet/datasets rows (default text)")
    parser.add_argument("--split", default="train", help="the split of a saved DatasetDict (default train)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="every round(1/F)-th piece (document, or 64 KiB of a text file) is held out "
                             "(default 0.01)")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: one per CPU)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.data.prepare import PrepareOptions, prepare

    result = prepare(PrepareOptions(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer,
                                    field=args.field, split=args.split, val_fraction=args.val_fraction,
                                    workers=args.workers, shard_tokens=args.shard_tokens))
    m = result.manifest
    print(json.dumps({"out": args.out, "train_tokens": m["splits"]["train"]["tokens"],
                      "val_tokens": m["splits"]["val"]["tokens"], "documents": m["documents"],
                      "shards": len(m["splits"]["train"]["shards"]) + len(m["splits"]["val"]["shards"]),
                      "dtype": m["dtype"], "seconds": round(result.seconds, 3),
                      "tokens_per_s": round(result.tokens / max(result.seconds, 1e-9))}), file=sys.stdout)
    return 0
