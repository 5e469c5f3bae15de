"""Errors raised while finding, reading or interpreting model files.

Each names what went wrong and what the user can do about it.
"""


class ModelLoadError(Exception):
    """A model path or weight file cannot be used (missing, truncated, inconsistent)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one pagedjax implements."""
