"""Export of a checkpoint as a Hugging Face directory (gpt as GPT2LMHeadModel, llama), generate, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config, public_dict
from swarmtrain.data.tokenizer import load_tokenizer
from swarmtrain.diloco.flat import flatten
from swarmtrain.models import build_model
from swarmtrain.models.generate import generate
from swarmtrain.models.spec import resolve_run
from swarmtrain.sync.checkpoint import save_checkpoint
from swarmtrain.sync.export import ExportError, export_checkpoint, model_from_checkpoint

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers", reason="the hf extra")


def _checkpoint(tmp_path: Path, *overrides: str, run_config: bool = True) -> tuple[Path, torch.nn.Module]:
    cfg = resolve_run(load_config(overrides=["data.seq_len=32", *overrides]))
    model = build_model(cfg.model, seed=3)
    with torch.no_grad():  # weights no init would give: the export must carry θ, not rebuild it
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    meta = {"worker": {"round": 4}, "hash": "h"} | ({"run_config": public_dict(cfg)} if run_config else {})
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, tensors={"theta_global": flatten(list(model.parameters()))}, meta=meta)
    return directory, model.eval()


HF_CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "tie_word_embeddings": True}


@pytest.mark.parametrize("arch", [["model.arch=gpt"], ["model.arch=llama"],
                                  ["model.arch=llama", "model.tie_embeddings=true"], ["model.arch=hf"]])
def test_exports_load_with_transformers_and_give_the_same_logits(tmp_path: Path, arch: list[str]) -> None:
    if arch == ["model.arch=hf"]:
        (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
        arch = [*arch, f"model.hf_path={json.dumps(str(tmp_path / 'config.json'))}"]
    directory, model = _checkpoint(tmp_path, *arch)
    out = export_checkpoint(directory, tmp_path / "home")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(idx)[0] - theirs(input_ids=idx).logits).abs().max().item() <= 1e-4
    assert json.loads((out / "swarmtrain.json").read_text())["provenance"]["round"] == 4
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(directory, out)


def test_export_errors_name_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    directory, _ = _checkpoint(tmp_path, "model.arch=llama", run_config=False)
    with pytest.raises(ExportError, match=r"ckpt-\d+\.json: the checkpoint has no run config"):
        export_checkpoint(directory, tmp_path / "out")
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"], "a failed export leaves nothing"


def test_generate_samples_deterministically(tmp_path: Path) -> None:
    directory, _ = _checkpoint(tmp_path, "model.arch=llama")
    model, cfg, _ = model_from_checkpoint(directory)
    tok = load_tokenizer(cfg.data.tokenizer)
    a = generate(model, tok, "def ", max_new_tokens=6, context_len=32, temperature=0.0)
    b = generate(model, tok, "def ", max_new_tokens=6, context_len=32, temperature=0.0)
    c = generate(model, tok, "def ", max_new_tokens=40, context_len=32, temperature=1.0, seed=1)
    assert a == b and 0 < len(a) <= 6 and 0 < len(c) <= 40  # a byte token decodes to at most one character
