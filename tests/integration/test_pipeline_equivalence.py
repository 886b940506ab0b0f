"""S stages × 1 server, 1 trainer, synchronous stepping, fp32 activations: after 20 steps the weights
equal those of the same GPT trained in one process on the same micro-batches; the same with every tensor
sent over the servers' bulk port instead of inside the gRPC calls, and for the built-in llama (tied and
untied) cut into stages."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.testing.pipeline import PipelineSwarm, reference_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 20


def _config(stages: int, n_layer: int, bulk_min_bytes: int = 1 << 30, max_message_bytes: int = 8 << 20,
            extra: tuple[str, ...] = ()):
    return load_config(overrides=[*extra, f"pipeline.bulk_min_bytes={bulk_min_bytes}",
                                  f"rpc.max_message_bytes={max_message_bytes}",
                                  f"rpc.chunk_bytes={min(max_message_bytes, 1 << 20)}",
        "model.preset=tiny", f"model.n_layer={n_layer}", "data.seq_len=16", "inner.warmup_steps=3",
        "inner.grad_clip=0", "diloco.rounds=4", "diloco.inner_steps=5", f"pipeline.stages={stages}",
        "pipeline.microbatch_size=2", "pipeline.samples_per_step=6", "rpc.run_key='k'",
    ])


def _batches(cfg, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    n, t = cfg.pipeline.samples_per_step, cfg.data.seq_len
    return [(torch.randint(0, 256, (n, t), generator=g), torch.randint(0, 256, (n, t), generator=g))
            for _ in range(steps)]


def _train_in_one_process(cfg, batches) -> tuple[torch.nn.Module, list[float]]:
    model = reference_model(cfg)
    opt = build_inner_optimizer(model, cfg.inner)
    total = cfg.diloco.rounds * cfg.diloco.inner_steps
    size, n = cfg.pipeline.microbatch_size, cfg.pipeline.samples_per_step
    losses = []
    for step, (idx, targets) in enumerate(batches):
        set_lr(opt, cfg.inner.lr * lr_factor(step, cfg=cfg.inner, total_steps=total))
        step_losses = []
        for i in range(0, n, size):
            _, loss = model(idx[i:i + size], targets[i:i + size])
            assert loss is not None
            (loss * size / n).backward()
            step_losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
    return model, losses


# (stages, layers, pipeline.bulk_min_bytes, rpc.max_message_bytes, tensors over the bulk port)
CASES = [(2, 2, 1 << 30, 8 << 20, False), (3, 4, 1 << 30, 8 << 20, False),
         (2, 2, 1, 8 << 20, True),  # every tensor from 1 byte up
         (2, 2, 0, 70_000, True)]  # 0: only what a call could not carry (8 KB here, past 70 KB less headroom)


@pytest.mark.parametrize(("stages", "n_layer", "bulk_min_bytes", "max_message_bytes", "via_bulk"), CASES)
def test_pipeline_training_equals_one_process(stages: int, n_layer: int, bulk_min_bytes: int,
                                              max_message_bytes: int, via_bulk: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from swarmtrain.rpc import bulk

    moved_in_bulk = {"upload": 0, "download": 0}

    def spying(name: str):
        real = getattr(bulk, name)

        def spy(*args, **kw):
            moved_in_bulk[name] += 1
            return real(*args, **kw)
        return spy

    for name in moved_in_bulk:
        monkeypatch.setattr(bulk, name, spying(name))
    cfg = _config(stages, n_layer, bulk_min_bytes, max_message_bytes)
    batches = _batches(cfg, STEPS)
    reference, ref_losses = _train_in_one_process(cfg, batches)
    with PipelineSwarm(cfg, max_inflight=1) as swarm:
        trainer = swarm.pipeline_trainers[0]
        reports = [trainer.step(idx, targets, timeout_s=60) for idx, targets in batches]
        got = swarm.model()
    assert [r.lost for r in reports] == [0] * STEPS and [r.rerouted for r in reports] == [0] * STEPS
    calls = STEPS * 3 * 2 * stages  # micro-batches × (forward, backward) × stages
    assert moved_in_bulk == ({"upload": calls, "download": calls} if via_bulk else {"upload": 0, "download": 0})
    assert all(s.server.step == STEPS for s in swarm.servers)
    assert [r.loss for r in reports] == pytest.approx(ref_losses, rel=1e-5)
    ref_state, got_state = reference.state_dict(), got.state_dict()
    moved = max((ref_state[k] - reference_model(cfg).state_dict()[k]).abs().max().item() for k in ref_state)
    assert moved > 1e-3  # 20 steps changed the weights: the comparison below means something
    for name, t in ref_state.items():
        torch.testing.assert_close(got_state[name], t, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tie", ["false", "true"])
def test_llama_pipeline_training_equals_one_process(tie: str) -> None:
    cfg = _config(2, 3, extra=("model.arch=llama", f"model.tie_embeddings={tie}"))
    batches = _batches(cfg, 8)
    reference, ref_losses = _train_in_one_process(cfg, batches)
    assert type(reference).__name__ == "Llama" and len(reference.model.layers) == 3
    with PipelineSwarm(cfg, max_inflight=1) as swarm:
        reports = [swarm.pipeline_trainers[0].step(idx, targets, timeout_s=60) for idx, targets in batches]
        got = swarm.model()
    assert [r.loss for r in reports] == pytest.approx(ref_losses, rel=1e-5)
    ref_state, got_state = reference.state_dict(), got.state_dict()
    assert sorted(got_state) == sorted(ref_state)
    for name, t in ref_state.items():
        torch.testing.assert_close(got_state[name], t, rtol=1e-4, atol=1e-6, msg=name)
