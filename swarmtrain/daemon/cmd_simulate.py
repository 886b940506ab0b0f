"""`swarmtrain simulate`: K DiLoCo or NoLoCo workers (or the data-parallel baseline) trained in this process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from swarmtrain.daemon.options import add_config_options, config_from_args

HELP = "train K simulated workers in one process with DiLoCo, NoLoCo gossip or data-parallel (ddp); write results JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["diloco", "noloco", "ddp"], default="diloco",
                        help="diloco: H inner steps then an all-reduce and an outer step; noloco: H inner steps then "
                             "a gossip round in small groups (averaging.gossip_*); ddp: K×batch, one step per step")
    parser.add_argument("--group-size", type=int, metavar="G",
                        help="noloco: peers per gossip group (averaging.gossip_group_size)")
    parser.add_argument("--workers", type=int, default=4, metavar="K", help="simulated workers (default 4)")
    parser.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per round (diloco.inner_steps)")
    parser.add_argument("--rounds", type=int, metavar="R", help="rounds (diloco.rounds); ddp runs R×H steps")
    parser.add_argument("--model", metavar="PRESET", help="model preset (model.preset)")
    parser.add_argument("--seed", type=int, metavar="S", help="seed of weights and data order (train.seed)")
    parser.add_argument("--codec", metavar="NAME", help="pseudo-gradient codec (compress.codec); diloco only")
    parser.add_argument("--data", nargs="+", metavar="PATH", help="text files to train on (default: Python stdlib)")
    parser.add_argument("--byzantine", type=int, default=0, metavar="N",
                        help="the last N workers send --attack instead of their pseudo-gradient (diloco only)")
    parser.add_argument("--attack", choices=["scale", "signflip", "random", "nan"], default="scale",
                        help="what a Byzantine worker sends: Δ×100, −4Δ, noise of 10× Δ's norm, or Δ with NaN")
    parser.add_argument("--aggregator", choices=["mean", "trimmed_mean"],
                        help="how contributions are combined (averaging.aggregator)")
    parser.add_argument("--out", metavar="JSON", help="write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_config_options(parser)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    pairs = [("diloco.inner_steps", args.inner_steps), ("diloco.rounds", args.rounds),
             ("model.preset", args.model), ("train.seed", args.seed), ("compress.codec", args.codec),
             ("averaging.aggregator", args.aggregator), ("averaging.gossip_group_size", args.group_size)]
    out = [f"{key}={json.dumps(value)}" for key, value in pairs if value is not None]
    if args.data:
        out.append(f"data.paths={json.dumps(args.data)}")
    return out


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from swarmtrain.averaging.aggregate import Aggregation
    from swarmtrain.averaging.attacks import with_byzantine
    from swarmtrain.averaging.inprocess import InProcessGroup
    from swarmtrain.compress import codec_from_config, get_codec
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.simulation import RoundRecord, simulate_ddp, simulate_diloco
    from swarmtrain.diloco.worker import round_device_of

    if args.workers < 1:
        print(f"swarmtrain simulate: error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    if not 0 <= args.byzantine < args.workers:
        print(f"swarmtrain simulate: error: --byzantine must be in [0, --workers={args.workers}), got {args.byzantine}",
              file=sys.stderr)
        return 2
    if args.mode != "diloco" and (args.byzantine or args.aggregator):
        print("swarmtrain simulate: error: --byzantine and --aggregator apply to --mode diloco", file=sys.stderr)
        return 2
    if args.mode != "noloco" and args.group_size is not None:
        print("swarmtrain simulate: error: --group-size applies to --mode noloco", file=sys.stderr)
        return 2
    if args.mode == "noloco" and args.workers < 2:
        print(f"swarmtrain simulate: error: --mode noloco needs --workers >= 2, got {args.workers}", file=sys.stderr)
        return 2
    if args.mode == "ddp" and args.codec:
        print("swarmtrain simulate: error: --codec applies to --mode diloco (ddp sends fp32 gradients)",
              file=sys.stderr)
        return 2
    overrides = _flag_overrides(args) + (['averaging.mode="gossip"'] if args.mode == "noloco" else [])
    cfg = config_from_args(args, overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    try:
        corpus = load_corpus(cfg.data)
        codec = codec_from_config(cfg.compress, seed=cfg.train.seed,  # on the device the workers' rounds run on
                                  device=round_device_of(cfg))
    except ValueError as e:  # CorpusError, CodecOptionError
        print(f"swarmtrain simulate: error: {e}", file=sys.stderr)
        return 2
    bar = tqdm(total=cfg.diloco.rounds, desc=f"{args.mode} K={args.workers}", unit="round", file=sys.stderr,
               disable=args.no_progress)

    def on_round(record: RoundRecord) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{record.loss:.3f}", val=f"{record.val_loss:.3f}", MB=f"{record.bytes_sent / 1e6:.1f}")

    gossip = None
    try:
        if args.mode == "ddp":
            result = simulate_ddp(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=args.workers,
                                  wire_codec=get_codec("fp32"), on_round=on_round)
        elif args.mode == "noloco":
            from swarmtrain.diloco.gossip_simulation import simulate_noloco

            result, gossip = simulate_noloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val,
                                             num_workers=args.workers, codec=codec, on_round=on_round)
        else:
            group = InProcessGroup(codec, num_workers=args.workers,
                                   aggregation=Aggregation(cfg.averaging.aggregator, cfg.averaging.trim,
                                                           gather=cfg.averaging.gathers(codec.name)))
            average_all = group.average_all if not args.byzantine else with_byzantine(
                group.average_all, num_workers=args.workers, byzantine=args.byzantine, name=args.attack,
                seed=cfg.train.seed)
            result = simulate_diloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=args.workers,
                                     average_all=average_all, codec=codec, on_round=on_round)
    except ValueError as e:  # e.g. a corpus too small for K×batch windows, seq_len > context_len
        print(f"swarmtrain simulate: error: {e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    summary = result.to_json(cfg)
    summary["data"] = corpus.source
    if gossip is not None:
        summary["gossip"] = gossip.to_json()
    summary["byzantine"] = {"workers": args.byzantine, "attack": args.attack if args.byzantine else None,
                            "aggregator": cfg.averaging.aggregator}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"{args.mode}: K={args.workers} final val loss {result.final_val_loss:.4f}, "
          f"{summary['tokens']} tokens, {summary['bytes_sent']} bytes sent per worker"
          + (f" -> {args.out}" if args.out else ""))
    return 0
