"""The GPT: shapes, causality, tied embeddings, seeded init, preset sizes."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import ModelConfig
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit


def test_forward_loss_and_causality() -> None:
    m = build_model(ModelConfig(preset="tiny"), seed=0).eval()
    x = torch.randint(0, 256, (2, 16))
    logits, loss = m(x, torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and loss is not None
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    l2, _ = m(x2)
    assert torch.allclose(logits[:, :10], l2[:, :10], atol=1e-5)  # the future never leaks back
    assert not torch.allclose(logits[:, 10:], l2[:, 10:])


def test_tied_and_seeded() -> None:
    a = build_model(ModelConfig(preset="tiny"), seed=1)
    b = build_model(ModelConfig(preset="tiny"), seed=1)
    assert a.head.weight is a.tok_emb.weight
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_preset_sizes_and_bad_shapes() -> None:
    assert 0.1e6 < build_model(ModelConfig(preset="tiny")).num_params() < 0.2e6
    with pytest.raises(ValueError, match="divisible"):
        build_model(ModelConfig(preset="tiny", n_embd=66))
    with pytest.raises(ValueError, match="context_len"):
        build_model(ModelConfig(preset="tiny", context_len=8))(torch.zeros(1, 9, dtype=torch.long))


def test_init_from_loads_given_weights_and_names_what_does_not_fit(tmp_path) -> None:
    from swarmtrain.config import ConfigError, load_config
    from swarmtrain.models import save_init_weights

    small = load_config(overrides=["model.preset=small"]).model
    source = build_model(small, seed=7)
    path = tmp_path / "init.safetensors"
    save_init_weights(source, path)
    loaded = build_model(load_config(overrides=["model.preset=small", f"model.init_from={path}"]).model, seed=0)
    assert all(torch.equal(a, b)
               for a, b in zip(source.state_dict().values(), loaded.state_dict().values(), strict=True))
    with pytest.raises(ConfigError, match="does not fit this model"):
        build_model(load_config(overrides=["model.preset=tiny", f"model.init_from={path}"]).model, seed=0)
    with pytest.raises(ConfigError, match="no such file"):
        build_model(load_config(overrides=[f"model.init_from={tmp_path / 'missing.safetensors'}"]).model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors"):
        build_model(load_config(overrides=[f"model.init_from={tmp_path / 'junk.safetensors'}"]).model)
