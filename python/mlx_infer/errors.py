"""The errors mlx-infer raises for bad input: each says what was wrong and how to fix it.

All are ``ValueError`` subclasses, so callers that catch ``ValueError`` keep working;
the CLI prints their message (no traceback) and exits with status 2.
"""

from __future__ import annotations


class MlxInferError(ValueError):
    """Base class of every user-facing error mlx-infer raises."""


class ModelLoadError(MlxInferError):
    """A model path, config, weights file or GGUF could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture (``model_type`` / GGUF arch) has no graph here."""


class PromptTooLongError(MlxInferError):
    """The prompt (plus requested tokens) does not fit the model's context window."""
