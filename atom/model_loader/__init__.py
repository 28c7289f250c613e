"""Model loading: HF folders, GGUF files and the embedded default model.

Importing this package is light (no torch), so the CLI can catch `ModelLoadError` cheaply;
weight loading lives in `atom.model_loader.weights`.
"""

from atom.model_loader.resolve import ModelLoadError, resolve_model, served_name

__all__ = ["ModelLoadError", "resolve_model", "served_name"]
