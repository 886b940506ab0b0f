"""Shared fixtures: tiny configs, one torch thread per test process, leak checks."""

from __future__ import annotations

import threading

import pytest
import torch

from swarmtrain.config import RunConfig, load_config

torch.set_num_threads(1)


@pytest.fixture
def tiny_config() -> RunConfig:
    """A ~0.1M-parameter model on a capped stdlib corpus: fast enough for unit tests."""
    return load_config(overrides=[
        "model.preset=tiny", "data.seq_len=64", "data.batch_size=4", "data.max_corpus_bytes=2000000",
        "inner.warmup_steps=2", "diloco.inner_steps=4", "diloco.rounds=3", "diloco.eval_batches=2",
    ])


@pytest.fixture
def no_thread_leak():
    """Fail a test that leaves non-daemon threads running."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"threads left running: {[t.name for t in leaked]}"
