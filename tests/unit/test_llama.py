"""The built-in llama against transformers' LlamaForCausalLM, and the hf architecture's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.diloco.fragments import fragment_ranges
from swarmtrain.models import build_model
from swarmtrain.models.build import count_params

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers", reason="the hf extra")


def _cfg(*extra: str):  # type: ignore[no-untyped-def]
    return load_config(overrides=["model.arch=llama", "model.preset=tiny", "model.vocab_size=300",
                                  "data.tokenizer=unused.json", *extra])


def _reference(model: torch.nn.Module, *, tie: bool) -> torch.nn.Module:
    s = model.shape
    config = transformers.LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=s.n_embd, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_kv_head,
        max_position_embeddings=s.context_len, rms_norm_eps=model.norm_eps, rope_theta=model.rope_theta,
        tie_word_embeddings=tie)
    ref = transformers.LlamaForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    ref.load_state_dict(state, strict=not tie)
    return ref


@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], ["model.n_kv_head=4"],
                                   ["model.rope_theta=500000.0", "model.norm_eps=1e-6"]])
def test_logits_and_gradients_equal_transformers_llama(extra: list[str]) -> None:
    cfg = _cfg(*extra)
    model = build_model(cfg.model, seed=1).eval()
    ref = _reference(model, tie=cfg.model.tie_embeddings)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in model.named_parameters()]
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(idx)[0], ref(input_ids=idx).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_seeded_init_is_reproducible_and_ignores_the_global_rng() -> None:
    cfg = _cfg()
    torch.manual_seed(1)
    a = build_model(cfg.model, seed=5)
    torch.manual_seed(2)
    b = build_model(cfg.model, seed=5)
    c = build_model(cfg.model, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones_like(sa["model.norm.weight"]))
    assert abs(sa["lm_head.weight"].std().item() - 0.02) < 0.003
    assert count_params(cfg.model) == sum(p.numel() for p in a.parameters())


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    cfg = _cfg()
    plain = build_model(cfg.model, seed=3)
    saved = build_model(cfg.model, seed=3, activation_checkpointing=True)
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    for m in (plain, saved):
        m.train()
        m(idx[:, :-1], idx[:, 1:])[1].backward()
    for p, q in zip(plain.parameters(), saved.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_fragments_cut_llama_by_layer() -> None:
    model = build_model(_cfg("model.n_layer=4").model, seed=0)
    names, offsets, at = [], [], 0
    for name, p in model.named_parameters():
        names.append(name)
        offsets.append((at, at + p.numel()))
        at += p.numel()
    frags = fragment_ranges(model, 2)

    def owner(name: str) -> int:
        lo, hi = offsets[names.index(name)]
        return next(f for f, ranges in enumerate(frags) if any(a <= lo and hi <= b for a, b in ranges))

    assert owner("model.layers.0.mlp.up_proj.weight") == owner("model.layers.2.self_attn.o_proj.weight") == 0
    assert owner("model.layers.1.mlp.up_proj.weight") == owner("model.layers.3.input_layernorm.weight") == 1
    assert owner("model.embed_tokens.weight") == owner("lm_head.weight") == 0


def test_hf_arch_builds_the_config_json_model_with_a_seeded_init(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 64}))
    cfg = load_config(overrides=["model.arch=hf", f"model.hf_path={json.dumps(str(path))}", "data.seq_len=32"])
    a, b = build_model(cfg.model, seed=4), build_model(cfg.model, seed=4)
    assert type(a.hf).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    idx = torch.randint(0, 256, (2, 32))
    logits, loss = a.eval()(idx, idx)
    assert torch.equal(logits, a.hf(input_ids=idx).logits)
    assert (loss is not None
            and abs(loss.item() - torch.nn.functional.cross_entropy(logits.view(-1, 256), idx.view(-1)).item()) < 1e-6)
    assert count_params(cfg.model) == sum(p.numel() for p in a.parameters())
    # A directory with weights starts from them.
    a.hf.save_pretrained(str(tmp_path / "weights"))
    warm = load_config(overrides=["model.arch=hf", f"model.hf_path={json.dumps(str(tmp_path / 'weights'))}",
                                  "data.seq_len=32"])
    c = build_model(warm.model, seed=99)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))
