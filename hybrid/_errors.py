"""Errors several parts of `hybrid` raise, in a module that imports nothing.

`ConfigError` is raised by the training config (`hybrid.training`) and by the checkpoint
preflight (`hybrid.checkpoint.prepare_run`); neither imports the other for it, nor the
training script (`hybrid.train`, which re-exports the name)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value that cannot be used (the message names the key)."""
