"""Built-in models. presets.py: named shapes; gpt.py: the GPT; llama.py: the Llama; hf.py: transformers' models
(the `hf` extra); build.py: `build_model(cfg)` for any `model.arch`; spec.py: the resolved model a run
agrees on (signature, fingerprint); export.py: a checkpoint as a Hugging Face directory."""

from swarmtrain.models.build import build_model
from swarmtrain.models.gpt import GPT, load_init_weights, resolve_shape, save_init_weights
from swarmtrain.models.presets import LLAMA_PRESETS, PRESETS

__all__ = ["GPT", "LLAMA_PRESETS", "PRESETS", "build_model", "load_init_weights", "resolve_shape", "save_init_weights"]
