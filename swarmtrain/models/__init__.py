"""Built-in models (their named shapes are swarmtrain/config_presets.py). gpt.py: the GPT; llama.py: the Llama; hf.py:
transformers' models (the `hf` extra); build.py: `build_model(cfg)` for any `model.arch`; spec.py: the resolved model
a run agrees on (signature, fingerprint); memory.py: the bytes a model's training state takes;
generate.py: sampling text from a trained model (`swarmtrain generate`)."""

from swarmtrain.config_presets import LLAMA_PRESETS, PRESETS
from swarmtrain.models.build import build_model
from swarmtrain.models.gpt import GPT, load_init_weights, resolve_shape, save_init_weights

__all__ = ["GPT", "LLAMA_PRESETS", "PRESETS", "build_model", "load_init_weights", "resolve_shape", "save_init_weights"]
