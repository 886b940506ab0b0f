"""A worker previews a named mean once per state: a voter asked about one value many times pays one outer step."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult, MeanShard, ShardedMean
from swarmtrain.diloco.worker import PREVIEWS_KEPT, DilocoWorker
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit


def _mean(numel: int, seed: int, key: str) -> ShardedMean:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
    return ShardedMean(numel, (MeanShard(0, numel, lambda out: out.copy_(values)),), key=key)


def test_a_named_mean_is_previewed_once_per_state(tiny_config: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = DilocoWorker(tiny_config, model=build_model(tiny_config.model, seed=0), batches=iter([]),
                          device=torch.device("cpu"))
    calls: list[int] = []
    span = worker.span()
    real = span.preview
    monkeypatch.setattr(span, "preview", lambda *a: calls.append(1) or real(*a))
    a, b = _mean(worker.numel, 1, "a"), _mean(worker.numel, 2, "b")
    first = worker.preview(a, ())
    assert worker.preview(a, (("p", 1),)) != first and len(calls) == 1  # other voters: one step still
    assert worker.preview(_mean(worker.numel, 1, "a"), ()) == first and len(calls) == 1  # the same key
    assert worker.preview(b, ()) != first and len(calls) == 2
    unnamed = _mean(worker.numel, 1, "")
    assert worker.preview(unnamed, ()) == first and worker.preview(unnamed, ()) == first and len(calls) == 4
    for i in range(PREVIEWS_KEPT + 1):  # bounded: many values at once keep at most PREVIEWS_KEPT
        worker.preview(_mean(worker.numel, 10 + i, f"k{i}"), ())
    assert len(worker._previews) <= PREVIEWS_KEPT
    worker.apply(AverageResult(round=0, committed=True, mean=a, members=("x",)))
    assert worker.digest() == first  # the commit left the state its preview named
    before = len(calls)
    assert worker.preview(a, ()) != first and len(calls) == before + 1  # a new state: previewed again
