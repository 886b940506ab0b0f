"""Optional dependencies (the `hf` extra): import them by name, or fail with one line saying what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINT", "MissingExtraError", "require"]

INSTALL_HINT = "pip install 'swarmtrain[hf]'"


class MissingExtraError(ValueError):
    """An optional package a feature needs is not installed; the message names it and the install command."""


def require(module: str, *, purpose: str) -> ModuleType:
    """`importlib.import_module(module)`, or MissingExtraError naming `purpose` and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingExtraError(f"{purpose} needs the {top!r} package, which is not installed: {INSTALL_HINT}") from e
