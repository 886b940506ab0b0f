"""Convergence: DiLoCo (K workers, H inner steps) vs data-parallel training on the same tokens.

Every arm trains the same model from the same init on the same token stream (worker k's batch
at step t under DiLoCo is slot k of the data-parallel K×B batch at step t), for the same number
of optimizer steps per worker. Prints final val loss, its ratio to DDP and the bytes ratio, and
saves JSON + a loss-vs-tokens PNG under benchmarks/results/.

    python benchmarks/convergence.py                       # the README figures (2 processes)
    python benchmarks/convergence.py --codecs int8 int4+ef # extra DiLoCo arms at H=50
    # sparse vs int8
    python benchmarks/convergence.py --inner-steps --codecs int8 sparse+ef+d=0.01+beta=0.95+mom=0+nest=false
    python benchmarks/convergence.py --diloco-variant outer.lr=1.0,outer.momentum=0.8  # a tuning arm at H=50
    python benchmarks/convergence.py --corpora shakespeare --bpe-vocab 2048 --set model.arch=llama  # llama + a BPE

Every run also reports the final val loss in bits per byte of the validation text (comparable across
tokenizers); `--bpe-vocab N` trains a byte-level BPE of N tokens on the training part of tinyshakespeare
(the validation part is its last `data.val_fraction`) and tokenizes the corpora with it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


@dataclass(frozen=True)
class Arm:
    """One training configuration; `codec` like "int8", "int8+zstd" or "int4+ef" (see `codec_overrides`)."""

    name: str
    mode: str  # "ddp" | "diloco"
    inner_steps: int
    codec: str = "fp32"
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Job:
    corpus: str  # "stdlib" or a file path
    seed: int
    arm: Arm
    workers: int
    steps: int  # optimizer steps per worker
    overrides: tuple[str, ...]
    warm: WarmStart | None = None


@dataclass(frozen=True)
class WarmStart:
    """The shared start of every arm of one (corpus, seed): DDP trained on the stream's first `steps` steps."""

    steps: int
    tokens: int
    theta: bytes  # flat fp32 θ's raw bytes (plain bytes cross the fork pool without tensor/numpy machinery)
    rounds: tuple[dict[str, Any], ...]
    initial_val_loss: float


def build_arms(args: argparse.Namespace) -> list[Arm]:
    arms = [Arm(f"ddp lr={lr:g}", "ddp", args.ddp_round_steps, overrides=(f"inner.lr={lr!r}",)) for lr in args.ddp_lrs]
    arms += [Arm(f"diloco H={h}", "diloco", h) for h in args.inner_steps]
    arms += [Arm(f"diloco H=50 {c}", "diloco", 50, c, codec_overrides(c)) for c in args.codecs]
    arms += [Arm(f"diloco H=50 {v}", "diloco", 50, overrides=tuple(v.split(","))) for v in args.diloco_variants]
    return arms


CODEC_SUFFIXES = {"ef": "compress.error_feedback=true", "zstd": "compress.zstd_level=3",
                  "fp16scales": "compress.scale_dtype=fp16"}
# KEY=VALUE suffixes, e.g. "sparse+ef+d=0.01+b=2+beta=0.95+mom=0"
CODEC_KEYS = {"d": "compress.density", "b": "compress.bits", "beta": "compress.error_feedback_decay",
              "chunk": "compress.chunk_size", "combine": "averaging.combine", "mom": "outer.momentum",
              "nest": "outer.nesterov", "olr": "outer.lr"}


def codec_overrides(spec: str) -> tuple[str, ...]:
    """"int8+zstd+fp16scales" -> the overrides of that arm (suffixes: ef, zstd, fp16scales, and KEY=VALUE for
    the keys of CODEC_KEYS)."""
    codec, *suffixes = spec.split("+")
    out = [f"compress.codec={codec}"]
    for x in suffixes:
        key, _, value = x.partition("=")
        if value and key in CODEC_KEYS:
            out.append(f"{CODEC_KEYS[key]}={value}")
        elif x in CODEC_SUFFIXES:
            out.append(CODEC_SUFFIXES[x])
        else:
            raise SystemExit(f"codec arm {spec!r}: unknown suffix {x!r}; known: {sorted(CODEC_SUFFIXES)} and "
                             f"KEY=VALUE for {sorted(CODEC_KEYS)}")
    return tuple(out)


def run_job(job: Job) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from swarmtrain.averaging.aggregate import Aggregation
    from swarmtrain.averaging.inprocess import InProcessGroup
    from swarmtrain.compress import codec_from_config, get_codec
    from swarmtrain.config import load_config
    from swarmtrain.data import eval_batches, load_corpus
    from swarmtrain.data.evaluation import bits_per_byte, bytes_per_token
    from swarmtrain.data.tokenizer import load_tokenizer
    from swarmtrain.diloco.simulation import simulate_ddp, simulate_diloco
    from swarmtrain.diloco.worker import round_device_of

    arm = job.arm
    overrides = [*job.overrides, f"train.seed={job.seed}", f"diloco.inner_steps={arm.inner_steps}",
                 f"diloco.rounds={job.steps // arm.inner_steps}", *arm.overrides]
    if job.corpus != "stdlib":
        overrides.append(f"data.paths={json.dumps([job.corpus])}")
    cfg = load_config(overrides=overrides)
    corpus = load_corpus(cfg.data)
    start = {}
    if job.warm is not None:
        start = {"init_theta": torch.frombuffer(bytearray(job.warm.theta), dtype=torch.float32),
                 "start_step": job.warm.steps}
    if arm.mode == "ddp":
        result = simulate_ddp(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=job.workers,
                              wire_codec=get_codec("fp32"), **start)
    else:
        codec = codec_from_config(cfg.compress, seed=job.seed, device=round_device_of(cfg))
        group = InProcessGroup(codec, num_workers=job.workers,
                               aggregation=Aggregation(gather=cfg.averaging.gathers(codec.name)))
        result = simulate_diloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=job.workers,
                                 average_all=group.average_all, codec=codec, **start)
    out = result.to_json(cfg)
    out.update(arm=arm.name, corpus=corpus_label(job.corpus), seed=job.seed, tokenizer=cfg.data.tokenizer,
               tokenizer_sha256=load_tokenizer(cfg.data.tokenizer).info.hash)
    out["val_bytes_per_token"] = bytes_per_token(
        eval_batches(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                     num_batches=cfg.diloco.eval_batches), load_tokenizer(cfg.data.tokenizer))
    out["final_val_bpb"] = bits_per_byte(out["final_val_loss"], bytes_per_token=out["val_bytes_per_token"])
    if job.warm is not None:  # tokens count from the very start; the warm-start curve is shared by all arms
        out.update(warm_start_steps=job.warm.steps, warm_start_tokens=job.warm.tokens,
                   warm_start_val_loss=out["initial_val_loss"], initial_val_loss=job.warm.initial_val_loss)
        out["tokens"] += job.warm.tokens
        out["warm_start_rounds"] = list(job.warm.rounds)
        out["rounds"] = [{**p, "tokens": p["tokens"] + job.warm.tokens} for p in out["rounds"]]
    sys.stderr.write(f"  done {out['corpus']:<8} seed={job.seed} {arm.name:<22} val {out['final_val_loss']:.4f} "
                     f"({out['wall_s']:.0f}s)\n")
    return out


def warm_start(job: Job) -> WarmStart:
    """Train DDP (`job.arm`, its own warmup+cosine schedule) for `job.steps` steps: the shared checkpoint."""
    import torch

    torch.set_num_threads(1)
    from swarmtrain.compress import get_codec
    from swarmtrain.config import load_config
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.simulation import simulate_ddp

    overrides = [*job.overrides, f"train.seed={job.seed}", f"diloco.inner_steps={job.arm.inner_steps}",
                 f"diloco.rounds={job.steps // job.arm.inner_steps}", *job.arm.overrides]
    if job.corpus != "stdlib":
        overrides.append(f"data.paths={json.dumps([job.corpus])}")
    cfg = load_config(overrides=overrides)
    corpus = load_corpus(cfg.data)
    result = simulate_ddp(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=job.workers,
                          wire_codec=get_codec("fp32"))
    assert result.final_theta is not None
    sys.stderr.write(f"  warm start {corpus_label(job.corpus):<8} seed={job.seed} {job.arm.name} {job.steps} steps: "
                     f"val {result.final_val_loss:.4f} ({result.wall_s:.0f}s)\n")
    return WarmStart(steps=job.steps, tokens=result.rounds[-1].tokens, theta=result.final_theta.numpy().tobytes(),
                     rounds=tuple(asdict(r) for r in result.rounds), initial_val_loss=result.initial_val_loss)


def corpus_label(corpus: str) -> str:
    return "stdlib" if corpus == "stdlib" else Path(corpus).stem


def summarize(results: list[dict[str, Any]], arms: list[Arm]) -> list[dict[str, Any]]:
    rows = []
    for corpus in dict.fromkeys(r["corpus"] for r in results):
        # The fair baseline: per seed, the best of the DDP arms (each DDP lr is its own arm).
        ddp: dict[int, dict[str, Any]] = {}
        for r in results:
            if r["corpus"] == corpus and r["mode"] == "ddp":
                best = ddp.get(r["seed"])
                if best is None or r["final_val_loss"] < best["final_val_loss"]:
                    ddp[r["seed"]] = r
        for arm in arms:
            runs = [r for r in results if r["corpus"] == corpus and r["arm"] == arm.name]
            losses = [r["final_val_loss"] for r in runs]
            ratios = [r["final_val_loss"] / ddp[r["seed"]]["final_val_loss"] for r in runs]
            bytes_ratio = statistics.mean(ddp[r["seed"]]["bytes_sent"] / r["bytes_sent"] for r in runs)
            rows.append({"corpus": corpus, "arm": arm.name, "seeds": len(runs),
                         "val_loss": statistics.mean(losses), "val_loss_min": min(losses), "val_loss_max": max(losses),
                         "val_bpb": statistics.mean(r["final_val_bpb"] for r in runs),
                         "bpb_ratio_to_ddp": statistics.mean(r["final_val_bpb"] / ddp[r["seed"]]["final_val_bpb"]
                                                             for r in runs),
                         "loss_ratio_to_ddp": statistics.mean(ratios), "max_loss_ratio_to_ddp": max(ratios),
                         "bytes_sent": statistics.mean(r["bytes_sent"] for r in runs),
                         "ddp_bytes_over_arm": bytes_ratio, "tokens": runs[0]["tokens"]})
    return rows


# A yardstick whose val loss rose this far above its start at some round diverged for a while (an outer or inner
# lr tuned for another model): beating it says nothing. Tuned int8 runs here peak at most 2.2% above their start.
BASELINE_MAX_RISE = 1.05


def peak_rise(run: dict[str, Any]) -> float:
    """The highest val loss over a run's rounds, over its start (the warm-start checkpoint's loss, if any)."""
    start = run.get("warm_start_val_loss", run["initial_val_loss"])
    return max([start, *(p["val_loss"] for p in run["rounds"])]) / start


def sparse_checks(results: list[dict[str, Any]], rows: list[dict[str, Any]], arms: list[Arm]) -> str:
    """The sparse targets: each sparse arm's val loss within 1% of the int8 arm's (same seed), with >= 25x fewer
    bytes sent per worker than int8 DiLoCo, against an int8 run that did not diverge on the way."""
    lines = []
    for r in rows:
        if not r["arm"].startswith("diloco H=50 sparse"):
            continue
        int8 = {x["seed"]: x for x in results if x["corpus"] == r["corpus"] and x["arm"] == "diloco H=50 int8"}
        runs = [x for x in results if x["corpus"] == r["corpus"] and x["arm"] == r["arm"] and x["seed"] in int8]
        if not runs:
            continue
        worst = max(x["final_val_loss"] / int8[x["seed"]]["final_val_loss"] for x in runs)
        fewer = statistics.mean(int8[x["seed"]]["bytes_sent"] / x["bytes_sent"] for x in runs)
        rise = max(peak_rise(int8[x["seed"]]) for x in runs)
        ok = worst <= 1.01 and fewer >= 25 and rise <= BASELINE_MAX_RISE
        why = "" if rise <= BASELINE_MAX_RISE else (
            f" (int8 DiLoCo's val loss rose to {rise:.3f}x its start on the way: no yardstick, tune it first)")
        lines.append(f"{r['corpus']}: {r['arm']}: loss / int8 DiLoCo (worst seed) {worst:.4f}, int8 bytes / arm "
                     f"bytes {fewer:.1f}x, DDP bytes / arm bytes {r['ddp_bytes_over_arm']:.0f}x; within 1% and "
                     f">= 25x: {'yes' if ok else 'NO'}{why}\n")
    return "".join(lines)


def codec_checks(results: list[dict[str, Any]], rows: list[dict[str, Any]], arms: list[Arm]) -> str:
    """The codec targets: each codec arm's val loss within 0.5% of fp32 DiLoCo H=50 (same seed), and >= 200x
    fewer bytes than DDP."""
    lines = []
    codec_arms = {a.name for a in arms if a.codec not in ("fp32",) and not a.codec.startswith("sparse")}
    for r in rows:
        if r["arm"] not in codec_arms:
            continue
        fp32 = {x["seed"]: x["final_val_loss"] for x in results
                if x["corpus"] == r["corpus"] and x["arm"] == "diloco H=50"}
        runs = [x for x in results if x["corpus"] == r["corpus"] and x["arm"] == r["arm"] and x["seed"] in fp32]
        if not runs:
            continue
        worst = max(x["final_val_loss"] / fp32[x["seed"]] for x in runs)
        ok = worst <= 1.005 and r["ddp_bytes_over_arm"] >= 200
        lines.append(f"{r['corpus']}: {r['arm']}: loss / fp32 DiLoCo (worst seed) {worst:.4f}, DDP bytes / arm bytes "
                     f"{r['ddp_bytes_over_arm']:.0f}x; within 0.5% and >= 200x: {'yes' if ok else 'NO'}\n")
    return "".join(lines)


def print_table(rows: list[dict[str, Any]]) -> str:
    head = ("| corpus | arm | final val loss (mean, min–max over seeds) | loss / best DDP (mean; worst seed) "
            "| val bits/byte (/ best DDP) | bytes sent per worker | DDP bytes / arm bytes |\n"
            "|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['corpus']} | {r['arm']} | {r['val_loss']:.4f} ({r['val_loss_min']:.4f}–{r['val_loss_max']:.4f}) "
        f"| {r['loss_ratio_to_ddp']:.4f}; {r['max_loss_ratio_to_ddp']:.4f} | {r['val_bpb']:.4f} "
        f"({r['bpb_ratio_to_ddp']:.4f}) | {r['bytes_sent'] / 1e6:.1f} MB | {r['ddp_bytes_over_arm']:.1f}× |\n"
        for r in rows)
    return head + body


def plot(results: list[dict[str, Any]], arms: list[Arm], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = list(dict.fromkeys(r["corpus"] for r in results))
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora, strict=True):
        shown: list[float] = []
        for arm in arms:
            runs = [r for r in results if r["corpus"] == corpus and r["arm"] == arm.name]
            points = [[*r.get("warm_start_rounds", []), *r["rounds"]] for r in runs]
            tokens = [0] + [p["tokens"] for p in points[0]]
            curves = [[r["initial_val_loss"]] + [p["val_loss"] for p in pts]
                      for r, pts in zip(runs, points, strict=True)]
            mean = [statistics.mean(c[i] for c in curves) for i in range(len(tokens))]
            ax.plot([t / 1e6 for t in tokens], mean, label=arm.name, linestyle="--" if arm.mode == "ddp" else "-")
            shown += mean[max(1, len(mean) // 8):]  # the y range skips the steep start, where arms agree
        ax.set_title(f"{corpus}: val loss vs tokens (mean of {len(runs)} seeds)")
        ax.set_xlabel("tokens (millions, all workers)")
        ax.set_ylabel("validation loss (nats/token)")
        if shown:
            ax.set_ylim(min(shown) - 0.02, max(shown) + 0.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shakespeare", type=Path, default=DEFAULT_SHAKESPEARE, help="tinyshakespeare.txt path")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--workers", type=int, default=4, help="K")
    p.add_argument("--inner-steps", type=int, nargs="*", default=[25, 50, 100],
                   help="H values of the fp32 arms (none: DDP arms only, e.g. to add a DDP lr to a run)")
    p.add_argument("--codecs", nargs="*", default=[],
                   help="extra DiLoCo H=50 arms: CODEC[+ef][+zstd][+fp16scales], e.g. int8 int8+zstd int4+ef")
    p.add_argument("--diloco-variant", dest="diloco_variants", action="append", default=[],
                   metavar="SECTION.KEY=VALUE[,...]",
                   help="an extra fp32 DiLoCo H=50 arm with these overrides on top of --diloco-set (repeatable)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per worker (a multiple of every H)")
    p.add_argument("--ddp-lrs", type=float, nargs="+", default=[3e-3, 1.2e-2],
                   help="one DDP arm per inner lr; ratios are to the best DDP arm of each seed")
    p.add_argument("--ddp-round-steps", type=int, default=50, help="DDP steps per logged round")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for every arm")
    p.add_argument("--ddp-set", dest="ddp_overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for the DDP arm only (e.g. its own tuned inner.lr)")
    p.add_argument("--diloco-set", dest="diloco_overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for the DiLoCo arms only")
    p.add_argument("--corpora", nargs="+", choices=["stdlib", "shakespeare"], default=["stdlib", "shakespeare"])
    p.add_argument("--warm-start-steps", type=int, default=0,
                   help="DDP steps that every arm of a seed starts from (the DiLoCo paper's protocol); 0 = from init")
    p.add_argument("--warm-start-lr", type=float, default=1.2e-2, help="inner.lr of the warm-start DDP phase")
    p.add_argument("--processes", type=int, default=2, help="worker processes (1 torch thread each)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="output directory")
    p.add_argument("--tag", default="convergence", help="file name stem of the JSON/PNG")
    p.add_argument("--bpe-vocab", type=int, default=0,
                   help="train a byte-level BPE of this many tokens on tinyshakespeare's training part and train "
                        "every arm on its tokens (data.tokenizer, model.vocab_size); 0 = byte tokens")
    return p.parse_args()


def bpe_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """With --bpe-vocab: a BPE trained on the training part of tinyshakespeare (in a temp directory; the
    training is deterministic, and the results record the file's sha256)."""
    if not args.bpe_vocab:
        return ()
    from swarmtrain.config import DataConfig
    from swarmtrain.data.tokenizer_train import train_bpe

    text = args.shakespeare.read_text(encoding="utf-8")
    train_part = text[: int(len(text) * (1 - DataConfig().val_fraction))]
    path = Path(tempfile.mkdtemp(prefix="swarmtrain-bpe-")) / "tokenizer.json"
    size = train_bpe(iter([train_part[i:i + 65536] for i in range(0, len(train_part), 65536)]),
                     vocab_size=args.bpe_vocab, out=path)
    return f"data.tokenizer={json.dumps(str(path))}", f"model.vocab_size={size}"


# fp32 unless an arm names its codec: the H sweep and the variants are the baseline the codec arms are held to.
BASE_OVERRIDES = ("model.preset=tiny", "data.seq_len=128", "data.batch_size=8", "diloco.eval_batches=16",
                  "compress.codec=fp32")


def main() -> int:
    args = parse_args()
    for h in [*args.inner_steps, args.ddp_round_steps, *([50] if args.codecs or args.diloco_variants else [])]:
        if args.steps % h:
            raise SystemExit(f"--steps {args.steps} is not a multiple of H={h}")
    if args.warm_start_steps % args.ddp_round_steps:
        raise SystemExit(f"--warm-start-steps {args.warm_start_steps} is not a multiple of --ddp-round-steps")
    if not args.shakespeare.is_file():
        raise SystemExit(f"{args.shakespeare}: not found (pass --shakespeare PATH)")
    arms = build_arms(args)
    overrides = (*BASE_OVERRIDES, *bpe_overrides(args), *args.overrides)
    per_mode = {"ddp": tuple(args.ddp_overrides), "diloco": tuple(args.diloco_overrides)}
    corpora = [c if c == "stdlib" else str(args.shakespeare) for c in args.corpora]
    jobs = [Job(c, s, a, args.workers, args.steps, (*overrides, *per_mode[a.mode]))
            for c in corpora for s in args.seeds for a in arms]
    sys.stderr.write(f"{len(jobs)} runs on {args.processes} processes: K={args.workers}, {args.steps} steps per "
                     f"worker after {args.warm_start_steps} warm-start DDP steps, overrides {list(overrides)}\n")
    start = time.perf_counter()
    with mp.get_context("fork").Pool(args.processes, maxtasksperchild=1) as pool:
        if args.warm_start_steps:
            warm_arm = Arm(f"ddp lr={args.warm_start_lr:g}", "ddp", args.ddp_round_steps,
                           overrides=(f"inner.lr={args.warm_start_lr!r}",))
            warm_jobs = [Job(c, s, warm_arm, args.workers, args.warm_start_steps, (*overrides, *per_mode["ddp"]))
                         for c in corpora for s in args.seeds]
            warms = dict(zip([(j.corpus, j.seed) for j in warm_jobs], pool.map(warm_start, warm_jobs, chunksize=1),
                             strict=True))
            jobs = [replace(j, warm=warms[(j.corpus, j.seed)]) for j in jobs]
        results = pool.map(run_job, jobs, chunksize=1)
    rows = summarize(results, arms)
    table = print_table(rows)
    sys.stdout.write(table)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{args.tag}.json", args.out / f"{args.tag}.png"
    meta = {"argv": sys.argv, "workers": args.workers, "steps_per_worker": args.steps, "overrides": list(overrides),
            "ddp_overrides": args.ddp_overrides, "diloco_overrides": args.diloco_overrides,
            "wall_s": time.perf_counter() - start}
    json_path.write_text(json.dumps({"meta": meta, "table": rows, "runs": results}, indent=1) + "\n")
    plot(results, arms, png_path)
    check = [r for r in rows if r["arm"] == "diloco H=50"]
    for r in check:
        ok = r["max_loss_ratio_to_ddp"] <= 1.02 and r["ddp_bytes_over_arm"] >= 50
        sys.stdout.write(f"{r['corpus']}: DiLoCo H=50 within 2% of DDP and >= 50x fewer bytes: "
                         f"{'yes' if ok else 'NO'}\n")
    sys.stdout.write(codec_checks(results, rows, arms))
    sys.stdout.write(sparse_checks(results, rows, arms))
    sys.stdout.write(f"wrote {json_path} and {png_path} in {meta['wall_s']:.0f}s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
