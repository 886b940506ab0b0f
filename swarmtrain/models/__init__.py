"""Built-in models. presets.py: named shapes; gpt.py: the GPT and `build_model(cfg)`."""

from swarmtrain.models.gpt import GPT, build_model, load_init_weights, resolve_shape, save_init_weights
from swarmtrain.models.presets import PRESETS

__all__ = ["GPT", "PRESETS", "build_model", "load_init_weights", "resolve_shape", "save_init_weights"]
