"""The GPU-resident round (`train.round_device = "train"` on a CUDA peer) against the CPU's, bit for bit; skips
without CUDA. tests/unit/test_round_device.py runs the same functions on the CPU device."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmtrain.averaging.aggregate import Aggregation, encoded_aggregate
from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import codec_from_config, get_codec, staging
from swarmtrain.config import OuterConfig, RunConfig, load_config
from swarmtrain.data import load_corpus
from swarmtrain.diloco.flat import PseudoGradient, flatten, state_digest
from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.diloco.worker import DilocoWorker
from swarmtrain.models import build_model
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.testing.rounds import Seat, replay_rounds

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = {
    "fp32": ["compress.codec=fp32"],
    "int8-ef": ["compress.codec=int8", "compress.error_feedback=true"],
    "int4-fragments": ["compress.codec=int4", "diloco.fragments=2", "diloco.inner_steps=8"],
    "heavy-ball-fp16-scales": ["compress.codec=int8", "compress.scale_dtype=fp16", "outer.nesterov=false",
                               "outer.momentum=0.8", "outer.lr=0.5"],
}
BASE = ["model.preset=tiny", "data.seq_len=64", "data.batch_size=4", "diloco.inner_steps=4", "train.seed=9",
        "data.max_corpus_bytes=2000000", "inner.warmup_steps=2", "diloco.eval_batches=2"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("reducer", ["cuda", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_swarm_mixing_gpu_and_cpu_rounds_agrees_bit_for_bit(case: str, reducer: str) -> None:
    cfg = load_config(overrides=[*BASE, *CASES[case]])
    seats = [Seat("cuda", "train"), Seat("cuda", "cpu"), Seat("cpu", "train"), Seat("cuda", "train")]
    traces = replay_rounds(cfg, seats, rounds=4, reducer_device=reducer)
    for r, row in enumerate(traces):
        assert len({t.digest for t in row}) == 1, f"round {r}: the GPU and CPU rounds committed different states"
        assert all(t.preview == t.digest for t in row)
        assert row[0].theta_device.type == "cuda" and row[1].theta_device.type == "cpu"
        assert row[0].momentum_device is None or row[0].momentum_device.type == "cuda"
        assert row[0].residual_device is None or row[0].residual_device.type == "cuda"


@pytest.mark.parametrize("cfg", [OuterConfig(), OuterConfig(lr=0.3, momentum=0.8, nesterov=False),
                                 OuterConfig(lr=0.3, momentum=0.0, nesterov=False)])
def test_the_outer_step_on_the_gpu_is_the_cpu_s_to_the_bit(cfg: OuterConfig) -> None:
    gen = torch.Generator().manual_seed(4)
    n = 3 * (1 << 20) + 17
    theta = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 1e-3 for _ in range(3)]
    cpu, gpu = OuterOptimizer(cfg, numel=n), OuterOptimizer(cfg, numel=n, device="cuda")
    on_cpu, on_gpu = theta.clone(), theta.cuda()
    for g in grads:
        cpu.step(on_cpu, g)
        gpu.step(on_gpu, g.cuda())
    assert torch.equal(_bits(on_cpu), _bits(on_gpu))
    if cpu.momentum_buffer is not None:
        assert gpu.momentum_buffer is not None and torch.equal(_bits(cpu.momentum_buffer), _bits(gpu.momentum_buffer))


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "int8", "int4", "sparse"])
def test_gpu_codecs_encode_and_decode_the_cpu_codecs_bytes(name: str) -> None:
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(5)) * 1e-2
    cpu, gpu = get_codec(name), get_codec(name, device="cuda")
    data = cpu.encode(x)
    assert gpu.encode(x.cuda()) == data
    assert gpu.encode_from(lambda lo, hi: x.cuda()[lo:hi], x.numel()) == cpu.encode_from(lambda lo, hi: x[lo:hi],
                                                                                           x.numel())
    out_cpu, out_gpu = torch.ones(x.numel()), torch.ones(x.numel(), device="cuda")
    cpu.decode_accumulate(data, out_cpu)
    gpu.decode_accumulate(data, out_gpu)
    assert torch.equal(_bits(out_cpu), _bits(out_gpu))
    pieces = torch.cat([v.cpu() for _, v in gpu.decode_pieces(data, numel=x.numel())])
    assert torch.equal(_bits(pieces), _bits(cpu.decode(data).reshape(-1)))


@pytest.mark.parametrize("name", ["fp32", "int8", "int4"])
def test_a_reducer_on_the_gpu_sends_the_cpu_reducer_s_mean(name: str) -> None:
    gen = torch.Generator().manual_seed(6)
    parts = [get_codec(name).encode(torch.randn(70_000, generator=gen)) for _ in range(5)]
    pool = BufferPool()
    cpu = asyncio.run(encoded_aggregate(get_codec(name), parts, Aggregation(), numel=70_000, buffers=pool))
    gpu = asyncio.run(encoded_aggregate(get_codec(name, device="cuda"), parts, Aggregation(), numel=70_000,
                                        buffers=pool))
    trimmed = Aggregation(rule="trimmed_mean", trim=1)
    assert gpu == cpu
    assert asyncio.run(encoded_aggregate(get_codec(name, device="cuda"), parts, trimmed, numel=70_000, buffers=pool)) \
        == asyncio.run(encoded_aggregate(get_codec(name), parts, trimmed, numel=70_000, buffers=pool))


def test_host_staging_copies_device_bytes_through_pinned_memory() -> None:
    t = torch.randn(123_457, generator=torch.Generator().manual_seed(7))
    on = t.cuda()
    assert b"".join(bytes(c) for c in staging.host_chunks(on, chunk_bytes=4096)) == t.numpy().tobytes()
    with staging.arena():
        a, b = staging.host_bytes(on), staging.host_bytes(on * 2)
        assert bytes(a) == t.numpy().tobytes() and bytes(b) == (t * 2).numpy().tobytes()  # neither overwrote
        assert all(buf.is_pinned() for buf in staging._arena().buffers)
    with pytest.raises(RuntimeError, match="outside an arena"):
        staging.host_bytes(on)


def test_delta_reads_on_the_gpu_equal_the_cpu_s() -> None:
    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(64, 33, generator=gen), torch.randn(1000, generator=gen)]
    theta = flatten(params) + torch.randn(64 * 33 + 1000, generator=gen) * 1e-3
    cpu = PseudoGradient(theta, params, version=lambda: 0)
    gpu = PseudoGradient(theta.cuda(), [p.cuda() for p in params], version=lambda: 0)
    got = gpu.read(5, 3000)
    assert got.device.type == "cuda" and torch.equal(_bits(got), _bits(cpu.read(5, 3000)))


def _worker(cfg: RunConfig, round_device: str, batches: object) -> DilocoWorker:
    seat = cfg.replace(train={"device": "cuda", "round_device": round_device})
    codec = codec_from_config(cfg.compress, seed=0, device="cuda" if round_device == "train" else "cpu")
    return DilocoWorker(seat, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,  # type: ignore[arg-type]
                        device=torch.device("cuda"), codec=codec)


def test_a_gpu_peer_trains_rounds_with_its_state_on_the_gpu_and_resumes_on_a_host_round() -> None:
    from swarmtrain.peer.data import peer_batches

    cfg = load_config(overrides=[*BASE, "compress.codec=int8", "compress.error_feedback=true"])
    corpus = load_corpus(cfg.data)
    worker = _worker(cfg, "train", peer_batches(cfg, corpus.train, "gpu-peer"))
    assert worker.codec is not None
    group = InProcessGroup(worker.codec, num_workers=1)
    for _ in range(2):
        report = worker.run_round(group.member(0))
        assert report.committed
    assert worker.theta_global.device.type == "cuda" and worker.residual is not None
    assert worker.residual.device.type == "cuda"
    momentum = worker.outer.momentum_buffer
    assert momentum is not None and momentum.device.type == "cuda"
    assert worker.digest() == state_digest(worker.round, worker.theta_global.cpu(), momentum.cpu(), worker.voters)
    host = _worker(cfg, "cpu", peer_batches(cfg, corpus.train, "gpu-peer"))
    host.load_state_dict(*worker.state_dict())
    assert host.theta_global.device.type == "cpu" and host.digest() == worker.digest()
