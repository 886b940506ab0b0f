"""Activation codec benchmark: what `pipeline.activation_codec` saves on the wire of a SWARM pipeline and
what it costs in loss, one arm per codec on the same model, micro-batches and steps.

    python benchmarks/pipeline_codecs.py --steps 300 --codecs fp32,fp16,bf16,int8

Each arm is an in-process pipeline (`swarmtrain.testing.pipeline.PipelineSwarm`: stage servers and a
trainer on loopback gRPC), 2 stages × 1 server and 1 trainer, fixed seed, one micro-batch in flight at
a time, so the arms differ in the codec alone (fp32 equals single-process training on the same batches,
tests/integration/test_pipeline_equivalence.py). Every arm trains the initial weights on the same
stdlib-corpus batches for `--steps` inner steps; then the assembled model is evaluated on fixed
validation batches. Outer rounds never run (one server per stage).

Figures per arm:
  bytes per micro-batch   the activation and gradient payloads counted by the trainer's RpcNode
                          ByteCounters (sent + received; every tensor of the pipeline passes through the
                          trainer), divided by the micro-batches; gRPC/protobuf framing and call metadata
                          are not counted. Checked against S × 4 × the codec's encoded size of one tensor.
  train loss              mean trainer loss over the last 10 steps
  val loss                mean loss of the assembled model on the validation batches
  codec error             on the trained model's real boundary tensors (validation micro-batches, the
                          gradients scaled as in training): ‖x − decode(encode(x))‖ / ‖x‖ and
                          max |x − decode(encode(x))| / max |x|, worst over the tensors of each kind
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarmtrain.config import RunConfig, load_config  # noqa: E402
from swarmtrain.data import load_corpus  # noqa: E402
from swarmtrain.data.sharding import ShardedBatches, eval_batches  # noqa: E402
from swarmtrain.models.gpt import resolve_shape  # noqa: E402
from swarmtrain.pipeline.tensors import TensorCodec  # noqa: E402
from swarmtrain.testing.pipeline import PipelineSwarm, reference_model  # noqa: E402

RUN = [
    "model.preset=small", "data.max_corpus_bytes=2000000", "data.seq_len=64", "pipeline.stages=2",
    "pipeline.microbatch_size=4", "pipeline.samples_per_step=16", "inner.warmup_steps=20", "diloco.rounds=1",
    "train.seed=0", "train.threads=1", "rpc.run_key='activation codec benchmark'",
]
TAIL_STEPS = 10
Batch = tuple[torch.Tensor, torch.Tensor]


def arm_config(overrides: list[str], codec: str, steps: int) -> RunConfig:
    # diloco.inner_steps = steps: the learning-rate schedule decays over exactly the steps run
    return load_config(overrides=[*RUN, f"diloco.inner_steps={steps}", *overrides,
                                  f"pipeline.activation_codec={codec}"])


def data(cfg: RunConfig, steps: int, val_batches: int) -> tuple[list[Batch], list[Batch]]:
    corpus = load_corpus(cfg.data)
    stream = ShardedBatches(corpus.train, worker_index=0, num_workers=1, batch_size=cfg.pipeline.samples_per_step,
                            seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    train = [next(stream) for _ in range(steps)]
    val = eval_batches(corpus.val, batch_size=cfg.pipeline.microbatch_size, seq_len=cfg.data.seq_len,
                       num_batches=val_batches)
    return train, val


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: list[Batch]) -> float:
    model.eval()
    losses = [model(x, y)[1] for x, y in val]
    return float(torch.stack([loss for loss in losses if loss is not None]).mean())


def boundary_tensors(swarm: PipelineSwarm, cfg: RunConfig, val: list[Batch]) -> tuple[list[torch.Tensor],
                                                                                        list[torch.Tensor]]:
    """The activations and gradients the trainer sends and receives for `val`'s micro-batches, computed
    without the wire from the trained parts; gradients scaled by the micro-batch's share of a step."""
    ends = swarm.pipeline_trainers[0].ends
    parts = [s.server.part for s in sorted(swarm.servers, key=lambda s: s.stage)]
    scale = cfg.pipeline.microbatch_size / cfg.pipeline.samples_per_step
    activations, gradients = [], []
    for idx, targets in val:
        xs = [ends.embed(idx).detach().requires_grad_(True)]
        for part in parts:
            xs.append(part(xs[-1]))
            xs[-1].retain_grad()
        (ends.loss(xs[-1], targets) * scale).backward()
        activations += [x.detach().clone() for x in xs]
        gradients += [x.grad.detach().clone() for x in xs if x.grad is not None]
        for module in (ends, *parts):
            module.zero_grad(set_to_none=True)
    return activations, gradients


def codec_error(codec: TensorCodec, tensors: list[torch.Tensor]) -> dict[str, float]:
    rel_l2 = rel_max = 0.0
    for x in tensors:
        shape, data = codec.encode(x)
        err = codec.decode(shape, data, what="error check") - x
        rel_l2 = max(rel_l2, float(err.norm() / x.norm().clamp_min(1e-30)))
        rel_max = max(rel_max, float(err.abs().max() / x.abs().max().clamp_min(1e-30)))
    return {"rel_l2": rel_l2, "rel_max": rel_max}


def run_arm(cfg: RunConfig, train: list[Batch], val: list[Batch]) -> dict[str, Any]:
    pipe = cfg.pipeline
    shape = resolve_shape(cfg.model)
    codec = TensorCodec(pipe.activation_codec, max_shape=(pipe.microbatch_size, cfg.data.seq_len, shape.n_embd))
    one_tensor = len(codec.encode(torch.zeros(pipe.microbatch_size, cfg.data.seq_len, shape.n_embd))[1])
    start = time.monotonic()
    with PipelineSwarm(cfg, max_inflight=1) as swarm:
        reports = [swarm.pipeline_trainers[0].step(idx, targets, timeout_s=120) for idx, targets in train]
        train_s = time.monotonic() - start
        sent, received = swarm.trainer_nodes[0].counters.totals()
        model = swarm.model()
        activations, gradients = boundary_tensors(swarm, cfg, val)
    microbatches = sum(r.microbatches for r in reports)
    if any(r.lost or r.rerouted for r in reports):
        raise RuntimeError(f"{pipe.activation_codec}: micro-batches lost or re-sent; the byte count would not "
                           "be one pass per micro-batch")
    expected = microbatches * pipe.stages * 4 * one_tensor  # (forward, backward) × (call, reply) per stage
    if sent + received != expected:
        raise RuntimeError(f"{pipe.activation_codec}: counted {sent + received} bytes, expected {expected}")
    losses = [r.loss for r in reports]
    return {
        "codec": pipe.activation_codec, "steps": len(reports), "microbatches": microbatches,
        "bytes_sent": sent, "bytes_received": received, "bytes_per_microbatch": (sent + received) / microbatches,
        "encoded_tensor_bytes": one_tensor, "train_loss": sum(losses[-TAIL_STEPS:]) / len(losses[-TAIL_STEPS:]),
        "val_loss": val_loss(model, val), "train_s": train_s, "losses": losses,
        "activation_error": codec_error(codec, activations), "gradient_error": codec_error(codec, gradients),
    }


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def table(arms: list[dict[str, Any]]) -> str:
    base = next((a for a in arms if a["codec"] == "fp32"), arms[0])
    lines = [f"{'arm':<6} {'bytes/micro-batch':>18} {'÷ vs fp32':>10} {'train loss':>11} {'val loss':>9} "
             f"{'val vs fp32':>12} {'act err L2':>11} {'grad err L2':>12}"]
    for a in arms:
        lines.append(f"{a['codec']:<6} {a['bytes_per_microbatch']:>18,.0f} "
                     f"{base['bytes_per_microbatch'] / a['bytes_per_microbatch']:>10.2f} {a['train_loss']:>11.4f} "
                     f"{a['val_loss']:>9.4f} {100 * (a['val_loss'] / base['val_loss'] - 1):>+11.2f}% "
                     f"{a['activation_error']['rel_l2']:>11.2e} {a['gradient_error']['rel_l2']:>12.2e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--codecs", default="fp32,fp16,bf16,int8")
    ap.add_argument("--val-batches", type=int, default=64, help="validation micro-batches")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a run config override on top of the benchmark's")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline-codecs.json"))
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    cfg = arm_config(args.set, codecs[0], args.steps)
    torch.set_num_threads(max(1, cfg.train.threads))
    train, val = data(cfg, args.steps, args.val_batches)
    arms = []
    for name in codecs:
        arm = run_arm(arm_config(args.set, name, args.steps), train, val)
        print(json.dumps({k: v for k, v in arm.items() if k != "losses"}), flush=True)
        arms.append(arm)
    base = next((a for a in arms if a["codec"] == "fp32"), arms[0])
    for a in arms:
        a["bytes_ratio_vs_fp32"] = base["bytes_per_microbatch"] / a["bytes_per_microbatch"]
        a["val_loss_vs_fp32_pct"] = 100 * (a["val_loss"] / base["val_loss"] - 1)
    print(table(arms))
    shape = resolve_shape(cfg.model)
    out = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": git_commit(),
           "overrides": [*RUN, f"diloco.inner_steps={args.steps}", *args.set],
           "workload": {"preset": cfg.model.preset, "n_layer": shape.n_layer, "n_embd": shape.n_embd,
                        "stages": cfg.pipeline.stages, "seq_len": cfg.data.seq_len,
                        "microbatch_size": cfg.pipeline.microbatch_size,
                        "samples_per_step": cfg.pipeline.samples_per_step, "steps": args.steps,
                        "val_sequences": sum(x.shape[0] for x, _ in val),
                        "initial_val_loss": val_loss(reference_model(cfg), val)},
           "bytes_counted": "tensor payloads by the trainer's RpcNode ByteCounters (sent + received), without "
                            "gRPC/protobuf framing",
           "arms": arms}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
