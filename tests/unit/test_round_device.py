"""Where the round runs (`train.round_device`): the same functions on any device, checked here on every device
this machine has (the CPU always; CUDA where present, and tests/gpu pins the CUDA round against the CPU's)."""

from __future__ import annotations

import hashlib

import blake3
import numpy as np
import pytest
import torch

from swarmtrain.compress import codec_from_config, get_codec, staging
from swarmtrain.config import ConfigError, RunConfig, load_config
from swarmtrain.diloco.flat import PseudoGradient, flat_hash, flatten, state_digest, tensor_digest
from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.diloco.worker import DilocoWorker, resolve_round_device
from swarmtrain.models import build_model
from swarmtrain.peer.config import merge_run_config
from swarmtrain.testing.rounds import Seat, replay_rounds

pytestmark = pytest.mark.unit

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

CASES = {
    "fp32": ["compress.codec=fp32"],
    "int8-ef": ["compress.codec=int8", "compress.error_feedback=true"],
    "int4-fragments": ["compress.codec=int4", "diloco.fragments=2", "diloco.inner_steps=8"],
    "heavy-ball": ["compress.codec=int8", "outer.nesterov=false", "outer.momentum=0.8", "outer.lr=0.5"],
}


def _cfg(tiny_config: RunConfig, case: str) -> RunConfig:
    return load_config(overrides=[*_overrides(tiny_config), *CASES[case]])


def _overrides(cfg: RunConfig) -> list[str]:
    return ["model.preset=tiny", f"data.seq_len={cfg.data.seq_len}", f"data.batch_size={cfg.data.batch_size}",
            "diloco.inner_steps=4", "train.seed=5"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_workers_whose_rounds_run_on_the_training_device_and_on_the_host_agree_bit_for_bit(
        tiny_config: RunConfig, device: str, case: str) -> None:
    cfg = _cfg(tiny_config, case)
    seats = [Seat(device, "train"), Seat(device, "cpu"), Seat("cpu", "train")]
    traces = replay_rounds(cfg, seats, rounds=3, reducer_device=device)
    hashes = set()
    for row in traces:
        assert len({t.digest for t in row}) == 1, "the workers' committed states differ"
        assert len({t.hash for t in row}) == 1
        assert all(t.preview == t.digest for t in row), "a preview named another state than the commit left"
        hashes.add(row[0].hash)
        mine, host, cpu = row
        assert mine.theta_device.type == device and host.theta_device.type == cpu.theta_device.type == "cpu"
        assert mine.momentum_device is None or mine.momentum_device.type == device
        assert mine.residual_device is None or mine.residual_device.type == device
    assert len(hashes) == 3, "θ_global did not move every round"


def test_a_replayed_round_equals_the_outer_step_on_the_decoded_mean(tiny_config: RunConfig) -> None:
    """The replay's bits against a reference written from the definitions: the mean of the decoded shards, then
    one separately rounded Nesterov step (numpy float32) on θ_global."""
    cfg = load_config(overrides=[*_overrides(tiny_config), "compress.codec=fp32"])  # the wire carries Δ exactly
    model = build_model(cfg.model, seed=cfg.train.seed)
    theta0 = flatten(model.parameters()).numpy()
    gen = torch.Generator().manual_seed(cfg.train.seed)
    moves = [(torch.randn(theta0.size, generator=gen) * 1e-2).numpy() for _ in range(2)]
    mean = np.zeros_like(theta0)
    for move in moves:
        local = theta0 + move  # what replay_rounds assigns as θ_local, in float32
        mean += theta0 - local
    mean /= np.float32(2)
    mu, lr = np.float32(cfg.outer.momentum), np.float32(cfg.outer.lr)
    buf = mean.copy()  # a zero buffer's first step: buf = g
    expected = theta0 - (mean + buf * mu) * lr
    traces = replay_rounds(cfg, [Seat(), Seat()], rounds=1)
    assert traces[0][0].hash == hashlib.sha256(expected.astype(np.float32).tobytes()).hexdigest()


def test_the_round_device_is_a_peer_s_own_key_and_is_checked() -> None:
    swarm = load_config()
    local = load_config(overrides=["train.round_device=cpu"])
    merged = merge_run_config(swarm, local, local_overrides=["train.round_device=cpu"])
    assert merged.train.round_device == "cpu"
    with pytest.raises(ConfigError, match=r"train\.round_device"):
        load_config(overrides=["train.round_device=gpu"])
    assert resolve_round_device("train", torch.device("cpu")) == torch.device("cpu")
    assert resolve_round_device("cpu", torch.device("cuda", 1)) == torch.device("cpu")


def test_a_worker_refuses_a_codec_on_another_device_than_its_round(tiny_config: RunConfig) -> None:
    model = build_model(tiny_config.model, seed=0)
    codec = get_codec("fp32", device="meta")
    with pytest.raises(ValueError, match="codec runs on meta but this worker's round runs on cpu"):
        DilocoWorker(tiny_config, model=model, batches=iter([]), device=torch.device("cpu"), codec=codec)


@pytest.mark.parametrize("device", DEVICES)
def test_delta_reads_stay_on_the_round_s_device_and_equal_the_difference(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(5, 7, generator=gen).to(device), torch.randn(13, generator=gen).to(device)]
    theta = flatten(params, device=device) + torch.randn(48, generator=gen).to(device)
    source = PseudoGradient(theta, params, version=lambda: 0)
    whole = theta - flatten(params, device=device)
    for lo, hi in ((0, 48), (3, 40), (35, 36), (48, 48)):
        got = source.read(lo, hi)
        assert got.device.type == device and torch.equal(got, whole[lo:hi])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 24])
def test_digests_streamed_in_slices_equal_the_digest_of_the_whole(device: str, chunk: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    whole = t.numpy().tobytes()
    monkeypatch.setattr(staging.host_chunks, "__kwdefaults__", {"chunk_bytes": chunk})
    on = t.to(device)
    assert b"".join(bytes(c) for c in staging.host_chunks(on)) == whole
    assert all(memoryview(c).nbytes <= chunk for c in staging.host_chunks(on))
    assert tensor_digest(on) == blake3.blake3(whole).digest()
    assert flat_hash(on) == hashlib.sha256(whole).hexdigest()
    assert state_digest(3, on, on * 2, [("p", 1)]) == state_digest(3, t, t * 2, [("p", 1)])
    assert list(staging.host_chunks(torch.empty(0, device=device))) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(staging.host_chunks(on, chunk_bytes=0))


def test_host_bytes_views_a_cpu_tensor_in_place() -> None:
    t = torch.arange(6, dtype=torch.float32)
    view = staging.host_bytes(t)
    t[0] = 42.0
    assert np.frombuffer(view, dtype=np.float32)[0] == 42.0  # no copy was made
    assert staging.host_bytes(torch.empty(0)).nbytes == 0


def test_the_staging_arena_keeps_every_part_of_one_block_and_reuses_its_memory() -> None:
    arena = staging._Arena()
    arena.depth = 1
    parts = [arena.take(n) for n in (100, 1 << 20, 7, 3 << 20)]
    for i, p in enumerate(parts):
        p.fill_(i)
    assert [int(p[0]) for p in parts] == [0, 1, 2, 3]  # none overwrote another
    assert len({p.data_ptr() for p in parts}) == 4
    total = sum(b.numel() for b in arena.buffers)
    arena.reset()
    assert len(arena.buffers) == 1 and arena.buffers[0].numel() == total  # one buffer for next time's parts
    again = [arena.take(n) for n in (100, 1 << 20, 7, 3 << 20)]
    assert all(p.data_ptr() >= arena.buffers[0].data_ptr() for p in again) and len(arena.buffers) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_outer_state_follows_its_device(device: str) -> None:
    from swarmtrain.config import OuterConfig

    opt = OuterOptimizer(OuterConfig(), numel=10, device=device)
    assert opt.momentum_buffer is not None and opt.momentum_buffer.device.type == device
    opt.load_state_tensors({"momentum": torch.ones(10)})  # a checkpoint's, read on the CPU
    assert opt.momentum_buffer.device.type == device and float(opt.momentum_buffer.sum()) == 10.0


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_of_a_host_round_resumes_on_the_training_device_with_the_same_digest(
        tiny_config: RunConfig, device: str) -> None:
    cfg = _cfg(tiny_config, "int8-ef")
    workers = []
    for round_device in ("cpu", "train"):
        seat_cfg = cfg.replace(train={"device": device, "round_device": round_device})
        codec = codec_from_config(cfg.compress, seed=0, device=resolve_round_device(round_device, torch.device(device)))
        workers.append(DilocoWorker(seat_cfg, model=build_model(cfg.model, seed=1), batches=iter([]),
                                    device=torch.device(device), codec=codec))
    host, mine = workers
    assert host.theta_global.device.type == "cpu"
    host.outer.momentum_buffer.add_(0.25)  # type: ignore[union-attr]
    assert host.residual is not None
    host.residual.add_(0.5)
    host.round = 4
    mine.load_state_dict(*host.state_dict())
    assert mine.digest() == host.digest() and mine.round == 4
    assert mine.theta_global.device.type == device and mine.residual is not None
    assert mine.residual.device.type == device and torch.equal(mine.residual.cpu(), host.residual)
    bad_tensors, meta = host.state_dict()
    bad_tensors["ef.residual"] = torch.zeros(3)
    before = mine.digest()
    with pytest.raises(ValueError, match="residual has shape"):
        mine.load_state_dict(bad_tensors, meta)
    mine._theta_version += 1  # recompute: nothing may have changed
    assert mine.digest() == before
